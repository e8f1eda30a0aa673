"""The Cage's state in one training process, and what it hands the user's loop.

:class:`CageProcess` holds what ``fn`` set up in this process (modules, optimizers, loaders)
and runs each per-process call of :class:`cardcage.Cage` on the backend's strategy.
:class:`CageModule`, :func:`cage_optimizer` and :class:`CageLoader` are what ``setup``
returns where the backend wraps, steps or shards: they run the user's call through the
backend and are the user's object otherwise.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from cardcage.backend.launch.watchdog import BACKWARD, SAVE, Heart
from cardcage.backend.strategy.precision import Precision
from cardcage.backend.strategy.step_runner import CALL, runner_in, trained_module
from cardcage.backend.strategy.strategy import Strategy
from cardcage.checkpoints import io as checkpoint
from cardcage.checkpoints.validation import read_saved
from cardcage.config.model_contract import Optimization
from cardcage.errors import MisconfigurationError

if TYPE_CHECKING:
    from cardcage.train.cage import Cage


class CageProcess:
    """The Cage's state in one training process: the modules, optimizers and loaders it set
    up, and the checks of the first backward."""

    def __init__(self, cage: Cage, heart: Heart | None, *, restarts: int, launched: bool = True):
        self.cage = cage
        self.strategy: Strategy = cage.accelerator
        self.heart = heart
        self.restarts = restarts
        self.launched = launched
        #: id of a user's module or of what setup returned -> (trained module, wrapper).
        self.modules: dict[int, tuple[torch.nn.Module, torch.nn.Module]] = {}
        #: What those ids belong to, held while ``fn`` runs: no other object takes an id.
        self.held: list[torch.nn.Module] = []
        self.trained: list[torch.nn.Module] = []
        #: id of a parameter a backend replaced -> its replacement (fsdp's shards).
        self.replaced: dict[int, torch.nn.Parameter] = {}
        #: The parameters of every module set up, as given and as trained (kept alive: no
        #: other object takes their ids).
        self.parameters: dict[int, torch.Tensor] = {}
        self.loaders = 0
        #: How deep inside ``no_backward_sync`` (a backward there does not communicate).
        self.unsynced = 0
        self.forwarded = False
        self.checked = False
        precision, kind = self.strategy.precision, type(self.strategy)
        self.plain = precision.scaler is None and all(
            getattr(type(precision), n) is getattr(Precision, n) for n in ("backward", "step")
        )
        self.plain_backward = self.plain and kind.backward is Strategy.backward
        self.plain_step = self.plain and kind.optimizer_step is Strategy.optimizer_step

    def beat(self) -> None:
        if self.heart is not None:
            self.heart.beat()

    @contextlib.contextmanager
    def joining(self, kind: int) -> Iterator[None]:
        """Beat, and mark this rank as inside a Cage collective of ``kind`` (the watcher's
        call slot) until it returns: a collective only some ranks call is named at once."""
        heart = self.heart
        if heart is None:
            yield
            return
        heart.beat()
        heart.enter(kind)
        try:
            yield
        finally:
            heart.leave()

    # -- setting up ---------------------------------------------------------------------------

    def setup_module(self, model: torch.nn.Module) -> torch.nn.Module:
        if not isinstance(model, torch.nn.Module):
            raise MisconfigurationError(
                f"cage.setup_module: got a {type(model).__name__}, not a torch.nn.Module."
            )
        if id(model) in self.modules:
            raise MisconfigurationError(
                f"cage.setup: this {type(model).__name__} was set up already. Set each module "
                "up once, and train with what setup returned."
            )
        before = dict(model.named_parameters())
        wrapped = self.strategy.setup_module(model)
        trained = trained_module(wrapped)
        after = dict(trained.named_parameters())
        for parameter in (*before.values(), *after.values()):
            self.parameters[id(parameter)] = parameter
        for name, parameter in before.items():
            new = after.get(name)
            if new is not None and new is not parameter:
                self.replaced[id(parameter)] = new
        self.trained.append(trained)
        self.held.append(model)
        autocast = self.strategy.precision.autocast
        if wrapped is model and autocast is None:
            self.modules[id(model)] = (trained, wrapped)
            return model
        if wrapped is model and autocast is not None:  # nothing wraps it: autocast here
            call: Callable[..., Any] = _Autocasting(model, autocast)
        elif runner_in(wrapped) is not None:  # its StepRunner enters the autocast
            call = functools.partial(wrapped, CALL)
        else:
            call = wrapped
        module = CageModule(trained, call, self)
        self.held.append(module)
        self.modules[id(model)] = self.modules[id(module)] = (trained, wrapped)
        return module

    def setup_optimizers(
        self, optimizers: tuple[torch.optim.Optimizer, ...]
    ) -> list[torch.optim.Optimizer]:
        if not self.trained:
            raise MisconfigurationError(
                "cage.setup_optimizers: no module was set up yet. Call cage.setup(model, "
                "*optimizers), or setup_module(model) first."
            )
        for optimizer in optimizers:
            self.check_holds_a_set_up_parameter(optimizer)
        rebuilt = [self.rebuild(optimizer) for optimizer in optimizers]
        view = StateView(self.cage, torch.nn.ModuleList(self.trained), Optimization(rebuilt))
        self.strategy.setup_optimizers(view)  # type: ignore[arg-type]
        ready = view.optimization.optimizers
        if self.plain_step:
            return ready
        return [cage_optimizer(optimizer, self) for optimizer in ready]

    def check_holds_a_set_up_parameter(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer that holds none of the set-up modules' parameters: stepping
        it would never change the model, silently."""
        inner = inner_optimizer(optimizer)
        held = [p for group in inner.param_groups for p in group["params"]]
        if any(id(p) in self.parameters for p in held):
            return
        kind = type(inner).__name__
        given = [m for m in self.held if not isinstance(m, CageModule)]
        modules = ", ".join(sorted({type(m).__name__ for m in given}))
        raise MisconfigurationError(
            f"cage.setup: the {kind} holds {len(held)} parameter(s), none of them a parameter "
            f"of the module set up ({modules}): stepping it would never train the model. "
            f"Pass the optimizer built over this model's parameters: "
            f"{kind}(model.parameters(), ...) of the model you pass to cage.setup."
        )

    def rebuild(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``optimizer`` itself, its groups re-bound in place to the replaced parameters.

        The object stays the user's (class, groups, hyperparameters, hooks): a learning-rate
        scheduler made over it before ``setup`` goes on driving the optimizer that steps.
        Each group's list of parameters is changed in place, so an optimizer that keeps a
        reference to it (LBFGS's ``_params``) sees the new ones too.
        """
        if isinstance(optimizer, CageOptimizer):
            raise MisconfigurationError(
                "cage.setup_optimizers: this optimizer was set up already. Set each one up once."
            )
        held = [p for group in optimizer.param_groups for p in group["params"]]
        if not any(id(p) in self.replaced for p in held):
            return optimizer
        if optimizer.state:
            raise MisconfigurationError(
                f"cage.setup: the {type(optimizer).__name__} has stepped already, and "
                f"distributed_backend={self.cage.selection.accelerator!r} replaces the "
                "parameters it holds. Set the model and optimizer up before training."
            )
        for group in optimizer.param_groups:
            group["params"][:] = [self.replaced.get(id(p), p) for p in group["params"]]
        optimizer.state.clear()  # keyed by parameter: nothing of the old ones may stay
        return optimizer

    def setup_loader(self, loader: Any) -> Any:
        strategy = self.strategy
        self.loaders += 1
        processed = strategy.process_dataloader(loader, train=True)
        sharded = processed is not loader or strategy.world_size > 1
        if not sharded and not strategy.moves_batches:
            return loader
        return CageLoader(processed, strategy)

    # -- training -----------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        if not self.checked:
            self.check_first_backward()
        self.beat()  # before it communicates: a rank that never gets here stays behind
        # It synchronizes the gradients: marked as a Cage collective (the call slot).
        heart = self.heart if not self.unsynced and self.strategy.world_size > 1 else None
        if heart is not None:
            heart.enter(BACKWARD)
        try:
            if self.plain_backward:
                loss.backward()  # type: ignore[no-untyped-call]
            else:
                self.strategy.backward(loss)
        finally:
            if heart is not None:
                heart.leave()
        self.beat()

    def check_first_backward(self) -> None:
        self.checked = True
        if not self.trained:
            raise MisconfigurationError(
                "cage.backward: no module was set up. Pass the model through "
                "cage.setup(model, optimizer) and train with what it returns."
            )
        if self.strategy.world_size <= 1:
            return
        wrappers = any(wrapped is not trained for trained, wrapped in self.modules.values())
        if wrappers and not self.forwarded:
            raise MisconfigurationError(
                f"cage.backward: the loss was not computed by a module that cage.setup "
                f"returned, so the {self.strategy.world_size} processes would not synchronize "
                "its gradients. Call the module setup returned (model = cage.setup(model, ...)), "
                "not the one you passed to it."
            )
        if not self.loaders and self.cage.flags.replace_sampler_ddp:
            raise MisconfigurationError(
                f"cage.backward: {self.strategy.world_size} processes train, but no loader went "
                "through cage.setup_dataloaders, so each would train on all of the data. Pass "
                "your loaders through it, or shard the data yourself and set "
                "replace_sampler_ddp=False."
            )

    def wrapper_of(self, module: torch.nn.Module, what: str) -> torch.nn.Module:
        found = self.modules.get(id(module))
        if found is None:
            raise MisconfigurationError(
                f"cage.{what}: this {type(module).__name__} was not set up. Pass the module "
                "that cage.setup returned."
            )
        return found[1]

    @contextlib.contextmanager
    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> Iterator[None]:
        wrapped = self.wrapper_of(module, "no_backward_sync")
        if not enabled:
            yield
            return
        strategy = self.strategy
        with contextlib.ExitStack() as stack:
            # skip_gradient_sync acts on strategy.parallel as it is when entered
            previous, strategy.parallel = strategy.parallel, wrapped
            try:
                stack.enter_context(strategy.skip_gradient_sync())
            finally:
                strategy.parallel = previous
            self.unsynced += 1
            try:
                yield
            finally:
                self.unsynced -= 1

    def clip_gradients(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float | None,
        clip_val: float | None,
    ) -> torch.Tensor | None:
        self.wrapper_of(module, "clip_gradients")
        if (max_norm is None) == (clip_val is None):
            raise MisconfigurationError(
                f"cage.clip_gradients(max_norm={max_norm!r}, clip_val={clip_val!r}): give "
                "exactly one: max_norm clips the total 2-norm, clip_val each element."
            )
        inner = inner_optimizer(optimizer)
        self.strategy.precision.unscale([inner])
        if max_norm is not None:
            return self.strategy.clip_gradients(inner, float(max_norm), "norm")
        self.strategy.clip_gradients(inner, float(clip_val or 0.0), "value")
        return None

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.strategy.optimizer_step(optimizer)
        self.strategy.precision.update()
        self.beat()

    # -- checkpoints --------------------------------------------------------------------------

    def owner(self, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        """The set-up module that holds ``optimizer``'s parameters."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for trained in self.trained:
            if any(id(p) in held for p in trained.parameters()):
                return trained
        raise MisconfigurationError(
            "cage.save/load: an optimizer holds parameters of no module that was set up. "
            "Set its module up first (cage.setup(model, optimizer))."
        )

    def split(
        self, state: dict[str, Any]
    ) -> tuple[dict[int, tuple[torch.nn.Module, str | None, list[str]]], list[str]]:
        """``state``'s modules and optimizers grouped by trained module, and its other keys."""
        groups: dict[int, tuple[torch.nn.Module, str | None, list[str]]] = {}
        others: list[str] = []
        for key, value in state.items():
            if isinstance(value, torch.nn.Module):
                found = self.modules.get(id(value))
                trained = found[0] if found is not None else value
            elif isinstance(value, torch.optim.Optimizer):
                trained = self.owner(inner_optimizer(value))
            else:
                others.append(key)
                continue
            _, module_key, opt_keys = groups.get(id(trained), (trained, None, []))
            if isinstance(value, torch.nn.Module):
                module_key = key
            else:
                opt_keys = [*opt_keys, key]
            groups[id(trained)] = (trained, module_key, opt_keys)
        return groups, others

    def save(self, path: str | os.PathLike[str], state: dict[str, Any]) -> None:
        with self.joining(SAVE):
            self.save_here(path, state)

    def save_here(self, path: str | os.PathLike[str], state: dict[str, Any]) -> None:
        groups, others = self.split(state)
        payload: dict[str, Any] = {key: state[key] for key in others}
        for trained, module_key, opt_keys in groups.values():
            optimizers = [inner_optimizer(state[k]) for k in opt_keys]
            view = StateView(self.cage, trained, Optimization(optimizers))
            gathered = self.strategy.gather_state(view)  # type: ignore[arg-type]
            if gathered is None:
                continue  # this rank does not write
            if module_key is not None:
                payload[module_key] = gathered["state_dict"]
            payload.update(zip(opt_keys, gathered["optimizers"], strict=True))
        if self.strategy.is_global_zero:
            checkpoint.save_atomic(self.strategy.portable(payload), path)
        self.strategy.barrier("save")
        self.beat()

    def load(self, path: str | os.PathLike[str], state: dict[str, Any]) -> dict[str, Any]:
        where = f"cage.load: {os.fspath(path)!r}"
        data = read_saved(path, where, "cage.save")
        if not isinstance(data, dict):
            raise MisconfigurationError(
                f"{where} holds a {type(data).__name__}, not the dict that cage.save writes. "
                "Give a file written by cage.save."
            )
        groups, _ = self.split(state)
        consumed: set[str] = set()
        for trained, module_key, opt_keys in groups.values():
            missing = [k for k in (module_key, *opt_keys) if k is not None and k not in data]
            if missing:
                raise MisconfigurationError(
                    f"cage.load: {os.fspath(path)!r} holds no {', '.join(map(repr, missing))} "
                    f"(it holds {', '.join(map(repr, data))})."
                )
            optimizers = [inner_optimizer(state[k]) for k in opt_keys]
            view = StateView(self.cage, trained, Optimization(optimizers))
            saved = {
                "state_dict": data[module_key] if module_key is not None else None,
                "optimizers": [data[k] for k in opt_keys],
            }
            if module_key is None:
                raise MisconfigurationError(
                    f"cage.load: {', '.join(map(repr, opt_keys))} come(s) without the module "
                    "whose parameters it holds: put that module in state too (the backend "
                    "restores a module and its optimizers together)."
                )
            self.strategy.restore_state(view, saved)  # type: ignore[arg-type]
            consumed.update(k for k in (module_key, *opt_keys) if k is not None)
        self.beat()
        return {key: value for key, value in data.items() if key not in consumed}


class StateView:
    """A module and its optimizers as the backend's Trainer-facing methods read them
    (``setup_optimizers``, ``gather_state``, ``restore_state``)."""

    def __init__(self, cage: Cage, model: torch.nn.Module, optimization: Optimization):
        self.model = model
        self.optimization = optimization
        self.flags = cage.flags
        self.selection = cage.selection


class _Autocasting:
    """A module's forward under the precision's autocast (as Fabric runs a set-up module's)."""

    def __init__(self, module: torch.nn.Module, autocast: Callable[[], Any]):
        self.module = module
        self.autocast = autocast

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.autocast():
            return self.module(*args, **kwargs)


class CageModule(torch.nn.Module):
    """What ``setup_module`` returns when the backend wraps or replaces a module: calling
    it runs the module through the backend; attributes, ``state_dict`` and
    ``load_state_dict`` are the module's own."""

    def __init__(self, module: torch.nn.Module, call: Callable[..., Any], process: CageProcess):
        super().__init__()
        self.module = module
        self.__dict__["_call"] = call
        self.__dict__["_process"] = process

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        process = self.__dict__["_process"]
        process.forwarded = True
        process.beat()  # before the wrapper's forward, which may wait for the other ranks
        return self.__dict__["_call"](*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_modules"]["module"], name)


class CageOptimizer:
    """Mixed into a subclass of the optimizer's own class (``isinstance`` holds, schedulers
    take it): ``step`` goes through the backend; the rest is the optimizer's."""

    _optimizer: torch.optim.Optimizer
    _process: CageProcess

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._process.step(self._optimizer)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        # torch's default without an argument: a backend's wrapper may take none
        if set_to_none:
            self._optimizer.zero_grad()
        else:
            self._optimizer.zero_grad(set_to_none=False)

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._optimizer.add_param_group(param_group)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self._optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self._optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self._optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._optimizer.defaults = value

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_optimizer"], name)

    def __repr__(self) -> str:
        return f"Cage({self._optimizer!r})"


def cage_optimizer(optimizer: torch.optim.Optimizer, process: CageProcess) -> Any:
    kind = type(f"Cage{type(optimizer).__name__}", (CageOptimizer, type(optimizer)), {})
    wrapped: Any = object.__new__(kind)
    wrapped.__dict__["_optimizer"] = optimizer
    wrapped.__dict__["_process"] = process
    return wrapped


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    inner: torch.optim.Optimizer = optimizer.__dict__.get("_optimizer", optimizer)
    return inner


class CageLoader:
    """A loader as the backend adapted it: each iteration reshuffles its sampler for the
    next epoch (``on_epoch_start``) and moves its batches to the device when needed."""

    def __init__(self, loader: Any, strategy: Strategy):
        self.loader = loader
        self.strategy = strategy
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (its shuffle order): for a loop that
        resumes mid-run, since each iteration counts one epoch from 0."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        strategy = self.strategy
        strategy.on_epoch_start(self.epoch, self.loader)
        self.epoch += 1
        if not strategy.moves_batches:
            yield from self.loader
            return
        for batch in self.loader:
            yield strategy.batch_to_device(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["loader"], name)
