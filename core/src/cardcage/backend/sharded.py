"""What a sharded data-parallel backend (FSDP2) does in each of its processes.

:class:`ShardedAccelerator` is :class:`~cardcage.backend.distributed.DistributedAccelerator`
(ranks, device, process group, placement, precision, the sampler, the collectives) with
FSDP2's ``fully_shard`` in place of DistributedDataParallel: ``wrap`` shards a copy of the
model (each submodule :func:`shard_targets` names, then the root), so that each rank holds a
shard of every parameter, gradient and optimizer state; every step runs through the root's
``__call__`` so that FSDP2 gathers its parameters; ``teardown`` gathers the full weights back
into the user's model. Checkpoints are one full file, as every backend's, or with
``CARDCAGE_FSDP_STATE_DICT=sharded`` a ``torch.distributed.checkpoint`` folder of shards. The
``fsdp`` plugin (``fsdp``, ``fsdp_spawn``) subclasses it, and so may any backend: they differ
only in how their processes come to exist (a script relaunch, torch.multiprocessing, Ray
actors).
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from cardcage.backend.accelerator import Availability, distributed_availability
from cardcage.backend.distributed import DistributedAccelerator, broadcast_from_rank_zero
from cardcage.backend.launch.workers import WorkerLauncher
from cardcage.backend.selection_types import Selection, SelectionContext
from cardcage.backend.trainer_protocol import TrainerProtocol
from cardcage.checkpoints.io import load as load_checkpoint_file
from cardcage.checkpoints.io import save_atomic as save_checkpoint_file
from cardcage.checkpoints.validation import LOOP_FILE
from cardcage.errors import MisconfigurationError

__all__ = ["ShardedAccelerator", "shard_targets", "state_dict_type"]

STATE_DICT = "CARDCAGE_FSDP_STATE_DICT"
FORMATS = ("full", "sharded")


def state_dict_type(env: Mapping[str, str]) -> str:
    """How ``save_checkpoint`` writes: ``CARDCAGE_FSDP_STATE_DICT``, ``full`` by default."""
    value = env.get(STATE_DICT, "full").strip().lower() or "full"
    if value not in FORMATS:
        raise MisconfigurationError(
            f"{STATE_DICT}={env[STATE_DICT]!r} is not a checkpoint format. Set it to 'full' "
            "(one file of unsharded tensors, the default) or 'sharded' (a folder with a shard "
            "per rank, written by torch.distributed.checkpoint)."
        )
    return value


def shard_targets(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules that get their own ``fully_shard``, innermost first.

    ``model.fsdp_modules`` names them: module classes (like Lightning's ``auto_wrap_policy``
    set) or a predicate ``f(module) -> bool``. Without it, every direct child that holds
    parameters. The root is sharded after them and takes the parameters left over.
    """
    policy = getattr(model, "fsdp_modules", None)
    if policy is None:
        return [c for c in model.children() if any(True for _ in c.parameters())]
    if isinstance(policy, Iterable) and all(isinstance(c, type) for c in policy):
        classes = tuple(policy)
        policy = lambda module: isinstance(module, classes)  # noqa: E731
    elif not callable(policy):
        raise MisconfigurationError(
            f"{type(model).__name__}.fsdp_modules={policy!r}: give module classes (for "
            "example {TransformerBlock}) or a function of a module returning a bool."
        )
    chosen = [m for m in model.modules() if m is not model and policy(m)]
    return chosen[::-1]  # innermost first: fully_shard wants the children sharded first


def redirected(module: torch.nn.Module, name: str, *args: Any, **kwargs: Any) -> Any:
    """``module.<name>(*args)`` run through ``module.__call__``, so that FSDP2's forward
    hooks on the root gather its parameters first (``training_step`` is not ``forward``).
    Inside, ``forward`` is the module's own again, for ``self(x)``."""
    method = getattr(module, name)
    own_forward = module.forward

    def forward(*a: Any, **k: Any) -> Any:
        module.forward = own_forward  # type: ignore[method-assign]
        return method(*a, **k)

    module.forward = forward  # type: ignore[method-assign]
    try:
        return module(*args, **kwargs)
    finally:
        module.__dict__.pop("forward", None)


def by_position(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (``get_optimizer_state_dict``'s) as a
    plain ``optimizer.state_dict()`` keys it: by position, so any backend can resume it."""
    ids: dict[str, int] = {}
    groups = [
        {**g, "params": [ids.setdefault(n, len(ids)) for n in g["params"]]}
        for g in state["param_groups"]
    ]
    return {"state": {ids[n]: v for n, v in state["state"].items()}, "param_groups": groups}


def by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of :func:`by_position` for an optimizer whose parameters are ``names``."""
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {names[i]: v for i, v in state["state"].items()}, "param_groups": groups}


class ShardedAccelerator(DistributedAccelerator):
    """Base of backends that train one FSDP2-sharded rank per process."""

    def __init__(self, selection: Any):
        super().__init__(selection)
        self.state_dict_type = state_dict_type(os.environ)  # fails before any process
        self.user_model: torch.nn.Module | None = None
        # The sharded copy that trains; it outlives fit, for save_checkpoint afterwards.
        self.sharded: torch.nn.Module | None = None

    @classmethod
    def check_selection(cls, selection: Selection, env: Mapping[str, str]) -> None:
        """select, the Trainer and ``cardcage explain`` refuse a bad CARDCAGE_FSDP_STATE_DICT
        alike, before anything starts."""
        super().check_selection(selection, env)
        state_dict_type(env)

    @classmethod
    def availability(cls, ctx: SelectionContext) -> Availability:
        from torch.distributed import fsdp

        if not hasattr(fsdp, "fully_shard"):
            why = f"torch {torch.__version__} has no FSDP2 (fully_shard)"
            return Availability(False, why, "pip install 'torch>=2.6'")
        return distributed_availability()

    # -- each rank ------------------------------------------------------------------------

    def setup_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """DistributedAccelerator's placement and precision, then :meth:`wrap`, which
        shards a copy of ``model``: the copy trains (the Trainer's ``configure_optimizers``
        sees its parameters; a Cage re-binds optimizers to them)."""
        self.user_model = model
        return super().setup_module(model)

    def sharded_model(self, trainer: TrainerProtocol) -> torch.nn.Module:
        """The sharded module whose state is ``trainer``'s: ``trainer.model`` while it trains
        (each module a Cage set up comes as one), else the copy the last fit trained."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(trainer.model, FSDPModule):
            return trainer.model
        assert self.sharded is not None, "no module was sharded in this process"
        return self.sharded

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """A copy of ``model``, sharded; ``model`` itself gives its memory back (meta
        tensors) until ``teardown`` loads the trained weights into it."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        low = {16: torch.float16, "bf16": torch.bfloat16}.get(self.precision.precision)
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None)
        sharded = copy.deepcopy(model)
        broadcast_from_rank_zero(sharded)  # before sharding: every shard cut from rank 0's
        for module in shard_targets(sharded):
            fully_shard(module, mp_policy=policy)
        fully_shard(sharded, mp_policy=policy)
        model.to("meta")
        self.sharded = sharded
        return sharded

    def step_function(self, model: torch.nn.Module, name: str) -> Callable[..., Any]:
        sharded = self.parallel
        if sharded is None:
            return super().step_function(model, name)
        return lambda *args, **kwargs: redirected(sharded, name, *args, **kwargs)

    @contextlib.contextmanager
    def skip_gradient_sync(self) -> Iterator[None]:
        """No reduce-scatter in the backward of the micro-batches before the last: each rank
        keeps its unsharded gradients, summed; the last micro-batch's backward reduce-scatters
        the sum. (``clip_gradients`` needs no override: ``clip_grad_norm_`` over the sharded
        DTensor gradients computes the total norm across the shards.)"""
        from torch.distributed.fsdp import FSDPModule

        sharded = self.parallel
        if not isinstance(sharded, FSDPModule):
            yield
            return
        sharded.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            sharded.set_requires_gradient_sync(True)

    def teardown(self, trainer: TrainerProtocol) -> None:
        """Put the user's model back in ``trainer.model`` with the full trained weights.

        After a failure there is none to gather (the peers are gone): the model stays
        empty, and a checkpoint is the way back."""
        sharded, self.parallel = self.parallel, None  # steps run the user's model again
        if sharded is None or self.user_model is None:
            return
        trainer.model, model = self.user_model, self.user_model
        if sys.exc_info()[0] is not None:
            return
        from torch.distributed.checkpoint import state_dict as sd

        full = sd.get_model_state_dict(sharded, options=sd.StateDictOptions(full_state_dict=True))
        model.to_empty(device=self.device)
        model.load_state_dict(full)
        self.barrier("teardown")

    # -- state ----------------------------------------------------------------------------

    @staticmethod
    def parameter_names(sharded: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
        named = {id(p): n for n, p in sharded.named_parameters()}
        return [named[id(p)] for g in optimizer.param_groups for p in g["params"]]

    def gather_state(self, trainer: TrainerProtocol) -> dict[str, Any] | None:
        """The full model and optimizer state, gathered on rank 0 (every rank must call)."""
        from torch.distributed.checkpoint import state_dict as sd

        sharded = self.sharded_model(trainer)
        options = sd.StateDictOptions(full_state_dict=True, cpu_offload=True)
        model = sd.get_model_state_dict(sharded, options=options)
        optimizers = []
        for optimizer in trainer.optimization.optimizers:
            if not optimizer.state:  # before the first step: FSDP would make up a state
                optimizers.append(optimizer.state_dict())
                continue
            state = sd.get_optimizer_state_dict(sharded, optimizer, options=options)
            optimizers.append(by_position(state) if state else state)
        # Ranks other than 0 drop what they gathered; all leave the gather together.
        self.barrier("gather_state")
        full = {"state_dict": model, "optimizers": optimizers} if self.is_global_zero else None
        return self.hand_on(full)

    def hand_on(self, state: dict[str, Any] | None) -> dict[str, Any] | None:
        """Rank 0's full ``state``, sent on to the other ranks that hand results back.

        FSDP gathers the full state on global rank 0 alone; workers started for a fit
        (``fsdp_spawn``) hand their results back from each node's local rank 0
        (:attr:`hand_back_ranks`), so with ``num_nodes > 1`` rank 0 sends each of them a copy
        (one transfer per further node, at every gather). Elsewhere it returns ``state``."""
        receivers = [rank for rank in self.hand_back_ranks if rank != 0]
        if not receivers or not issubclass(self.launcher, WorkerLauncher):
            return state
        import torch.distributed as dist

        if self.is_global_zero:
            for rank in receivers:
                dist.send_object_list([state], dst=rank)
        elif self.global_rank in receivers:
            holder: list[Any] = [None]
            dist.recv_object_list(holder, src=0)
            state = holder[0]
        return state

    def restore_state(self, trainer: TrainerProtocol, state: dict[str, Any]) -> None:
        """Each rank takes its shard of the full (or, from a folder, sharded) state."""
        from torch.distributed.checkpoint import state_dict as sd

        sharded = self.sharded_model(trainer)
        options = sd.StateDictOptions(full_state_dict=not state.get("sharded", False))
        sd.set_model_state_dict(sharded, state["state_dict"], options=options)
        for optimizer, saved in zip(
            trainer.optimization.optimizers, state["optimizers"], strict=True
        ):
            if not saved["state"]:
                optimizer.load_state_dict(saved)  # hyperparameters only
            elif state.get("sharded"):
                sd.set_optimizer_state_dict(sharded, optimizer, saved, options=options)
            else:
                named = by_name(saved, self.parameter_names(sharded, optimizer))
                sd.set_optimizer_state_dict(sharded, optimizer, named, options=options)

    def sharded_state(self, optimizers: dict[int, torch.optim.Optimizer]) -> dict[str, Any]:
        """This rank's shards: the model's and those of ``optimizers`` (by index)."""
        from torch.distributed.checkpoint import state_dict as sd

        assert self.sharded is not None
        return {
            "model": sd.get_model_state_dict(self.sharded),
            "optimizers": {
                str(i): sd.get_optimizer_state_dict(self.sharded, o) for i, o in optimizers.items()
            },
        }

    def save_checkpoint(self, trainer: TrainerProtocol, path: str | os.PathLike[str]) -> None:
        """``full``: one file (the default). ``sharded``: a folder, each rank writing its
        shards through ``torch.distributed.checkpoint``, and rank 0 the loop's state (with
        the settings of optimizers that have not stepped yet, which hold no shards)."""
        if self.state_dict_type == "full" or self.sharded is None:
            super().save_checkpoint(trainer, path)
            return
        from torch.distributed.checkpoint.state_dict_saver import save

        optimizers = trainer.optimization.optimizers
        save(
            self.sharded_state({i: o for i, o in enumerate(optimizers) if o.state}),
            checkpoint_id=path,
        )
        if self.is_global_zero:
            unstepped = [None if o.state else o.state_dict() for o in optimizers]
            state = {**trainer.loop_state(), "optimizers": unstepped, "sharded": True}
            save_checkpoint_file(state, Path(path) / LOOP_FILE)
        self.barrier("save_checkpoint")

    def load_checkpoint(
        self, trainer: TrainerProtocol, path: str | os.PathLike[str]
    ) -> dict[str, Any]:
        """A file as written by any backend, or a sharded folder, resharded for this job's
        ranks (any number of them)."""
        if not Path(path).is_dir():
            return super().load_checkpoint(trainer, path)
        from torch.distributed.checkpoint.state_dict_loader import load

        state = load_checkpoint_file(Path(path) / LOOP_FILE)
        optimizers = trainer.optimization.optimizers
        if len(state["optimizers"]) != len(optimizers):
            return {**state, "state_dict": None}  # the core names the mismatch
        stepped = {i: o for i, o in enumerate(optimizers) if state["optimizers"][i] is None}
        shards = self.sharded_state(stepped)  # this job's layout: DCP reads into it
        load(shards, checkpoint_id=path)
        for i in stepped:
            state["optimizers"][i] = shards["optimizers"][str(i)]
        return {**state, "state_dict": shards["model"]}
