"""``cardcage.Cage``: the cards for a training loop the user writes.

The Cage takes the Trainer's backend flags, makes the same selection, starts the processes
with the same launcher (through the ``cardcage_setup`` and ``cardcage_train`` hooks, with
restarts, the stuck-rank watcher and the first failure named), and in each of them drives the
backend's own per-process strategy: ``setup_environment`` before the user's function,
``setup_module`` for each module it sets up, ``setup_optimizers``, ``process_dataloader``,
``backward``, ``skip_gradient_sync``, ``clip_gradients``, ``optimizer_step``, the collectives,
``gather_state``/``restore_state`` for checkpoints and ``teardown``. A backend implements
that work once; the Trainer's loop and the Cage both call it.

Where the backend changes nothing (one process on the CPU at precision 32), ``setup`` returns
the user's own module, optimizers and loaders, so the loop runs exactly the plain loop's code.
The whole API is described in docs/own-loop.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
from collections.abc import Callable
from typing import Any

import torch

from cardcage.backend.accelerator import Accelerator
from cardcage.backend.launch.error_files import record_fit_finished
from cardcage.backend.launch.launcher import InProcessLauncher
from cardcage.backend.launch.restarts import RESTARTS, restart_count, this_run
from cardcage.backend.launch.watchdog import (
    ALL_GATHER,
    ALL_REDUCE,
    BARRIER,
    BROADCAST,
    RETURNED,
)
from cardcage.backend.launch.watchdog import attach as attach_heart
from cardcage.backend.selection_types import Selection
from cardcage.backend.strategy.strategy import Strategy, move_to
from cardcage.checkpoints import io as checkpoint
from cardcage.config.flags import FLAG_NAMES, LATER_FLAGS, did_you_mean
from cardcage.errors import MisconfigurationError
from cardcage.plugins import manager as plugins
from cardcage.selection.engine import select
from cardcage.train.cage_process import CageProcess
from cardcage.train.jobs import apply_process_flags, portable_backend, prepare_launch
from cardcage.train.process_state import as_found

#: The Trainer's flags that the Cage takes: those of the backend, not of the loop.
CAGE_FLAGS = (
    "gpus",
    "tpu_cores",
    "num_processes",
    "num_nodes",
    "distributed_backend",
    "precision",
    "auto_select_gpus",
    "sync_batchnorm",
    "replace_sampler_ddp",
    "find_unused_parameters",
    "benchmark",
    "deterministic",
    "default_root_dir",
    "max_restarts",
)


class Cage:
    """Run a training loop you write on the backend the flags and the environment select.

    ``Cage(**flags)`` takes the Trainer's backend flags (:data:`CAGE_FLAGS`);
    :meth:`launch` runs ``fn(cage, ...)`` in every training process; inside it the
    per-process methods (:meth:`setup`, :meth:`setup_dataloaders`, :meth:`backward`, ...)
    drive the backend. See docs/own-loop.md.
    """

    def __init__(
        self,
        gpus: Any = None,
        tpu_cores: Any = None,
        num_processes: int = 1,
        num_nodes: int = 1,
        distributed_backend: str | None = None,
        precision: int | str = 32,
        auto_select_gpus: bool = False,
        sync_batchnorm: bool = False,
        replace_sampler_ddp: bool = True,
        find_unused_parameters: bool | None = None,
        benchmark: bool = False,
        deterministic: bool = False,
        default_root_dir: str | os.PathLike[str] | None = None,
        max_restarts: int = 0,
        **unknown: Any,
    ):
        loop_flags = [name for name in unknown if name in FLAG_NAMES]
        if loop_flags:
            given = ", ".join(f"{name}={unknown[name]!r}" for name in loop_flags)
            raise MisconfigurationError(
                f"Cage({given}): {'it is a flag' if len(loop_flags) == 1 else 'they are flags'}"
                " of the Trainer's loop, and your own loop decides what "
                f"{'it does' if len(loop_flags) == 1 else 'they do'}. Leave "
                f"{'it' if len(loop_flags) == 1 else 'them'} out; the Cage takes "
                f"{', '.join(CAGE_FLAGS)}."
            )
        unknown_names = [n for n in unknown if n not in FLAG_NAMES and n not in LATER_FLAGS]
        if unknown_names:
            name = unknown_names[0]
            raise MisconfigurationError(
                f"Cage({name}={unknown[name]!r}): {name} is not a flag of the Cage."
                f"{did_you_mean(name, CAGE_FLAGS)} The Cage takes {', '.join(CAGE_FLAGS)}."
            )
        with plugins.slow_checks_named():
            self.selection: Selection = select(
                gpus=gpus,
                tpu_cores=tpu_cores,
                num_processes=num_processes,
                num_nodes=num_nodes,
                distributed_backend=distributed_backend,
                precision=precision,
                auto_select_gpus=auto_select_gpus,
                sync_batchnorm=sync_batchnorm,
                replace_sampler_ddp=replace_sampler_ddp,
                find_unused_parameters=find_unused_parameters,
                benchmark=benchmark,
                deterministic=deterministic,
                default_root_dir=default_root_dir,
                max_restarts=max_restarts,
                logger=False,
                **unknown,
            )
        self.flags = self.selection.flags
        registry = plugins.registry(os.environ)
        self._registry: plugins.Registry | None = registry
        backend = registry.accelerators[self.selection.accelerator].cls
        self.accelerator: Accelerator = backend(self.selection)
        _check_backend_splits_setup(self.accelerator)
        self._process: CageProcess | None = None

    # -- the job ------------------------------------------------------------------------------

    def explain(self) -> str:
        """Why this backend was chosen: every rule in order and the decision."""
        return self.selection.explain()

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(self, *args, **kwargs)`` in every training process; return rank 0's value.

        The processes come from the backend's launcher (spawned workers, a relaunch of the
        script, Horovod's runner, xmp), or are this one and its peers when a cluster
        (torchrun, srun, horovodrun) started them. Every process that calls ``launch`` gets
        rank 0's return value, which must be plain data (tensors, numbers, strings, lists,
        dicts): it may come back through ``torch.load(weights_only=True)``. A failing rank
        stops every rank and raises :class:`~cardcage.RankFailedError` naming it; with
        ``max_restarts`` the processes start ``fn`` again first (:attr:`restarts`).
        """
        if not callable(fn):
            raise MisconfigurationError(
                f"cage.launch({fn!r}): give the function to run in every process, called as "
                "fn(cage, *args, **kwargs)."
            )
        if self._process is not None and self._process.launched:
            raise MisconfigurationError(
                "cage.launch was called inside a launched function: every process already "
                "runs it. Call the function directly."
            )
        job = CageJob(self, fn, args, kwargs)
        with as_found(job):
            self.selection = job.selection = prepare_launch(self.selection, self.accelerator)
            hooks = job.hooks()
            with this_run(job):  # type: ignore[arg-type]  # what restarts read of a Trainer
                hooks.cardcage_setup(trainer=job, accelerator=self.accelerator)
                hooks.cardcage_train(trainer=job, accelerator=self.accelerator)
        return job.result

    # -- this process -------------------------------------------------------------------------

    @property
    def _here(self) -> CageProcess:
        """This process's state; outside ``launch``, set up lazily for a backend that trains
        in this one process, refused otherwise."""
        process = self._process
        if process is not None:
            return process
        launcher = self.accelerator.make_launcher()
        if type(launcher) is not InProcessLauncher or self.selection.world_size > 1:
            raise MisconfigurationError(
                f"distributed_backend={self.selection.accelerator!r} trains in processes that "
                "cage.launch starts: call the Cage's per-process methods (setup, backward, "
                "all_reduce...) inside the function you pass to cage.launch(fn)."
            )
        self.accelerator.own_loop = True
        self.accelerator.setup_environment()
        self._process = CageProcess(self, None, restarts=0, launched=False)
        return self._process

    @property
    def device(self) -> torch.device:
        return self._here.strategy.device

    @property
    def global_rank(self) -> int:
        return self.accelerator.global_rank

    @property
    def local_rank(self) -> int:
        return self.accelerator.local_rank

    @property
    def node_rank(self) -> int:
        return self.accelerator.node_rank

    @property
    def world_size(self) -> int:
        return self.accelerator.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.accelerator.global_rank == 0

    @property
    def restarts(self) -> int:
        """How many restarts (``max_restarts``, or a cluster's) this attempt of ``fn`` is on."""
        return self._process.restarts if self._process is not None else 0

    def setup(self, model: torch.nn.Module, *optimizers: torch.optim.Optimizer) -> Any:
        """``setup_module(model)``, then ``setup_optimizers(*optimizers)``: the model, or a
        tuple ``(model, *optimizers)``, to train with from here on."""
        module = self.setup_module(model)
        if not optimizers:
            return module
        wrapped = self.setup_optimizers(*optimizers)
        return (module, *(wrapped if isinstance(wrapped, tuple) else (wrapped,)))

    def setup_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """Place ``model`` on the backend (device, precision, wrapper or shards) and return
        the module to call: ``model`` itself where the backend adds nothing to it, else a
        module whose call runs it through the backend and whose ``state_dict`` is
        ``model``'s own. Optimizers created before it still work: pass them to
        :meth:`setup_optimizers` (a backend that replaces the parameters gets them re-bound
        to the new ones in place, so schedulers made over them keep working).
        """
        return self._here.setup_module(model)

    def setup_optimizers(self, *optimizers: torch.optim.Optimizer) -> Any:
        """The optimizers to step from here on (one, or a tuple): over the parameters of
        the modules set up (your own objects, re-bound in place where the backend replaced
        the parameters), adapted by the backend, stepping through it."""
        if not optimizers:
            raise MisconfigurationError("cage.setup_optimizers(): pass the optimizers to set up.")
        ready = self._here.setup_optimizers(optimizers)
        return ready[0] if len(ready) == 1 else tuple(ready)

    def setup_dataloaders(self, *loaders: Any) -> Any:
        """Each loader sharded for this rank (a ``DistributedSampler`` keeping its settings,
        or a sampler of your own dealt out across the ranks by a ``ShardedSampler``, unless
        ``replace_sampler_ddp=False``), reshuffled each time it is iterated, its
        batches moved to :attr:`device`; one loader, or a list."""
        if not loaders:
            raise MisconfigurationError("cage.setup_dataloaders(): pass the loaders to set up.")
        ready = [self._here.setup_loader(loader) for loader in loaders]
        return ready[0] if len(ready) == 1 else ready

    def backward(self, loss: torch.Tensor) -> None:
        """Compute the gradients of ``loss`` on the backend (its grad scaler, its
        synchronization of gradients across processes)."""
        self._here.backward(loss)

    def no_backward_sync(
        self, module: torch.nn.Module, enabled: bool = True
    ) -> contextlib.AbstractContextManager[None]:
        """A context in which backward of ``module``'s loss accumulates gradients without
        communicating; the next backward outside it synchronizes the accumulated sum."""
        return self._here.no_backward_sync(module, enabled)

    def clip_gradients(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float | None = None,
        clip_val: float | None = None,
    ) -> torch.Tensor | None:
        """Clip the gradients of ``optimizer``'s parameters (unscaled first): to a total
        2-norm of ``max_norm`` (returns the norm before clipping), or each element to
        ``[-clip_val, clip_val]`` (returns None). Exactly one of them."""
        return self._here.clip_gradients(module, optimizer, max_norm, clip_val)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The precision's autocast (``precision=16`` or ``"bf16"``); nothing otherwise."""
        autocast = self._here.strategy.precision.autocast
        return autocast() if autocast is not None else contextlib.nullcontext()

    def to_device(self, obj: Any) -> Any:
        """``obj`` (a module, a tensor, or lists, tuples and dicts of them) on :attr:`device`."""
        strategy = self._here.strategy
        if isinstance(obj, torch.nn.Module):
            return obj.to(strategy.device)
        return move_to(obj, strategy.device, strategy.precision.dtype)

    def barrier(self, name: str | None = None) -> None:
        """Wait until every process reaches this point."""
        here = self._here
        with here.joining(BARRIER):
            here.strategy.barrier(name)

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """``tensor`` summed (``op="sum"``) or averaged (``"mean"``) over every process."""
        if op not in ("mean", "sum"):
            raise MisconfigurationError(f"cage.all_reduce(op={op!r}): use 'mean' or 'sum'.")
        here = self._here
        with here.joining(ALL_REDUCE):
            return here.strategy.reduce(tensor, op)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's ``tensor`` (the same shape on each), stacked in rank order: shape
        ``(world_size, *tensor.shape)``."""
        here = self._here
        with here.joining(ALL_GATHER):
            return here.strategy.all_gather(tensor)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` as process ``src`` holds it (any picklable object)."""
        here = self._here
        with here.joining(BROADCAST):
            return here.strategy.broadcast(obj, src)

    def save(self, path: str | os.PathLike[str], state: dict[str, Any]) -> None:
        """Write ``state`` to one file; every process calls it, global rank 0 writes.

        Modules and optimizers in ``state`` go through the backend (a sharded one gathers
        them): the file holds full tensors, each module as its own ``state_dict()`` (no
        wrapper prefix), and loads with ``torch.load(path, weights_only=True)``. Other
        entries are stored as they are (plain data).
        """
        self._here.save(path, state)

    def load(self, path: str | os.PathLike[str], state: dict[str, Any]) -> dict[str, Any]:
        """Fill the modules and optimizers of ``state`` from ``path`` (written by
        :meth:`save`, on any backend) in place; return the file's other entries."""
        return self._here.load(path, state)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only."""
        if self.accelerator.global_rank == 0:
            print(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_registry"] = None  # pluggy's manager stays behind; the job reloads it
        state["_process"] = None  # each process sets its own up
        state["selection"], state["accelerator"] = portable_backend(
            self.selection, self.accelerator
        )
        return state


def _check_backend_splits_setup(accelerator: Strategy) -> None:
    """Refuse, by name, a backend that sets its processes up in ``setup_process`` alone: the
    Cage needs ``setup_environment`` and ``setup_module``, which such a backend leaves at
    the one-process defaults."""
    kind = type(accelerator)
    own_process = kind.setup_process is not Strategy.setup_process
    split = (
        kind.setup_environment is not Strategy.setup_environment
        or kind.setup_module is not Strategy.setup_module
    )
    if own_process and not split:
        raise MisconfigurationError(
            f"distributed_backend={accelerator.selection.accelerator!r} ({kind.__qualname__}) "
            "sets its processes up in setup_process only, which the Trainer calls; the Cage "
            "needs setup_environment (join the job) and setup_module (place a module), which "
            "it leaves at the one-process defaults. Train it with cardcage.Trainer, or ask "
            "its author to split setup_process into those two (docs/writing-a-plugin.md)."
        )


class CageJob:
    """One ``launch``, as the launchers and ``max_restarts`` see a job: what they pickle,
    what each training process runs (:meth:`run_fit_loop`), what comes back."""

    def __init__(
        self, cage: Cage, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ):
        self.cage = cage
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.selection = cage.selection
        # What restarts and the launchers read of a Trainer (nothing to train of their own).
        self.model = torch.nn.Module()
        self.train_dataloader: Any = None
        self.val_dataloaders: list[Any] = []
        self.current_epoch = self.global_step = self.batch_idx = 0
        self.in_epoch = False
        self.restarts = 0
        self.restart_from: str | None = None
        self.run: checkpoint.Run | None = None
        self.result: Any = None

    @property
    def flags(self) -> Any:
        return self.cage.flags

    @property
    def accelerator(self) -> Accelerator:
        return self.cage.accelerator

    def hooks(self) -> Any:
        self.attach()
        assert self.cage._registry is not None
        return self.cage._registry.hooks

    def attach(self) -> None:
        """Reconnect a job that arrived in a new process to this process's plugins."""
        if self.cage._registry is None:
            self.cage._registry = plugins.registry(os.environ)

    def pickled_parts(self) -> dict[str, Any]:
        """What a worker launcher pickles, for its message when something cannot be."""
        parts: dict[str, Any] = {"fn": self.fn}
        parts.update({f"args[{i}]": a for i, a in enumerate(self.args)})
        parts.update({f"kwargs[{k!r}]": v for k, v in self.kwargs.items()})
        return parts

    def run_fit_loop(self) -> Any:
        """Run ``fn`` in this training process: the backend's environment, ``fn``, rank 0's
        value for every rank, the backend's teardown (also after a failure)."""
        cage, strategy = self.cage, self.cage.accelerator
        apply_process_flags(self.flags)
        heart = attach_heart()  # before setup: a rank stuck there shows its pid and stack
        restarts = max(self.restarts, int(os.environ.get(RESTARTS, "0") or 0))
        process = CageProcess(cage, heart, restarts=max(restarts, restart_count(os.environ)))
        cage._process = process
        try:
            strategy.own_loop = True
            strategy.setup_environment()
            value = self.fn(cage, *self.args, **self.kwargs)
            with process.joining(RETURNED):  # a rank still inside a collective is named
                self.result = strategy.broadcast(value, 0) if strategy.world_size > 1 else value
        finally:
            cage._process = None
            try:
                strategy.teardown(self)  # type: ignore[arg-type]
            finally:
                if heart is not None:
                    heart.close()
        record_fit_finished()  # a rank that exits without this has left the job early
        return self.result

    def export_results(self) -> dict[str, Any] | None:
        """Rank 0's value, for the launching process (it must load with weights_only)."""
        value = self.result
        buffer = io.BytesIO()
        try:
            torch.save({"value": value}, buffer)
            buffer.seek(0)
            torch.load(buffer, weights_only=True)
        except Exception as error:
            raise MisconfigurationError(
                f"cage.launch: the function returned a {type(value).__name__}, which cannot "
                f"come back to the launching process ({type(error).__name__}: {error}). "
                "Return plain data: tensors, numbers, strings, lists and dicts of them."
            ) from None
        return {"value": value}

    def apply_results(self, result: dict[str, Any]) -> None:
        self.result = result["value"]

    def __getstate__(self) -> dict[str, Any]:
        from cardcage.checkpoints.io import rng_state

        state = self.__dict__.copy()
        state["selection"] = dataclasses.replace(self.selection, environment=None)
        state["caller_rng"] = rng_state()  # workers draw as the script would
        return state
