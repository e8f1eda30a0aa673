"""The horovod backend: Horovod's DistributedOptimizer, one process per rank.

Two ways to run it:

- **started by horovodrun or mpirun** (rule 100: ``HOROVOD_RANK`` or ``OMPI_COMM_WORLD_RANK``
  in the environment): every process trains as its Horovod rank, whatever backend was named;
- **``Trainer(distributed_backend="horovod", num_processes=N)`` under plain ``python``**: the
  calling process starts the N workers itself through Horovod's own Gloo runner
  (``horovod.run``), and rank 0's weights come back into the caller's model, as with
  ``ddp_spawn``. ``num_processes=1`` trains in the calling process (a Horovod job of one).

What each rank does (Lightning 1.0's HorovodAccelerator, with its bugs fixed):

- ``hvd.init()``; on GPUs the process is pinned to the GPU of its local rank;
- rank 0's parameters and buffers are broadcast to every rank, and so are the optimizers'
  state (or, when they have none yet, their hyperparameters: Horovod's
  ``broadcast_optimizer_state`` would first take a step with zero gradients to create state,
  which advances Adam's step count and applies weight decay once);
- the learning rate of every parameter group (and the schedulers' ``base_lrs``) is multiplied
  by ``hvd.size()``, as the seed did; ``CARDCAGE_HOROVOD_SCALE_LR=0`` (or a subclass with
  ``scale_lr = False``) keeps the learning rate ``configure_optimizers`` set;
- each optimizer is wrapped in ``hvd.DistributedOptimizer`` with the model's parameter names;
  gradients are averaged right after ``backward`` (``optimizer.synchronize()``), so that a
  model's ``on_after_backward`` (gradient clipping, at precision 16 after unscaling) sees the
  averaged gradients, and the step runs under ``optimizer.skip_synchronize()`` (through the
  grad scaler at precision 16);
- data is sharded by a ``DistributedSampler`` on the Horovod rank (``replace_sampler_ddp``);
- every epoch ends with ``hvd.join()``: a rank that ran out of batches early serves the
  others' allreduces with zeros instead of deadlocking, and when the ranks had uneven
  numbers of batches the weights and optimizer state of the rank that trained most are
  broadcast so that all ranks continue identical;
- ``barrier``, ``broadcast`` and ``reduce`` go through Horovod.

Discovery never imports horovod: ``availability`` looks for the module first and imports
``horovod.torch`` only when asked whether it can run.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import importlib.util
import logging
import os
import re
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, TypeVar

import torch

from cardcage.sdk import (
    ERROR_FILE,
    Accelerator,
    Availability,
    InProcessLauncher,
    Launcher,
    MisconfigurationError,
    RankFailedError,
    Resolution,
    Rule,
    SelectionContext,
    Trainer,
    WorkerLauncher,
    cpu_threads_per_process,
    fail,
    first_recorded,
    hookimpl,
    pickle_job,
    run_worker,
)

log = logging.getLogger("cardcage")
T = TypeVar("T")

INSTALL = (
    "build Horovod for this torch with `python plugins/horovod/build_horovod.py --install` from "
    "the cardcage repository (Horovod 0.28.1 needs a C++17 patch for torch 2), or "
    "HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 pip install 'cardcage[horovod]'"
)
SCALE_LR = "CARDCAGE_HOROVOD_SCALE_LR"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _hvd() -> Any:
    import horovod.torch as hvd

    return hvd


def started_by_horovod(ctx: SelectionContext) -> bool:
    """Whether horovodrun or mpirun started this process (the horovod cluster environment)."""
    return ctx.cluster.name == "horovod"


class HorovodAccelerator(Accelerator):
    name = "horovod"
    rules = (
        Rule(
            order=100,
            when=started_by_horovod,
            why="the process was started by horovodrun or mpirun",
            name="horovodrun",
        ),
    )
    #: Multiply the learning rates by the number of processes (the seed's behaviour);
    #: ``CARDCAGE_HOROVOD_SCALE_LR`` overrides it.
    scale_lr: ClassVar[bool] = True

    def __init__(self, selection: Any):
        super().__init__(selection)
        # Read when the Trainer is built, so a bad value fails before any process starts;
        # the workers of a self-launched job inherit the decision with the trainer.
        self.scale_lr_by_size = scale_lr_setting(os.environ, default=self.scale_lr)
        if selection.flags.sync_batchnorm and not selection.gpu_ids:
            raise MisconfigurationError(
                "sync_batchnorm=True with distributed_backend='horovod' needs GPUs: "
                "hvd.SyncBatchNorm synchronises CUDA tensors only. Set gpus=1 (one GPU per "
                "process), or sync_batchnorm=False on the CPU."
            )
        self.local_world_size = selection.num_processes
        self.distributed_optimizers: list[Any] = []
        self.uneven_warned = False
        # Names for the collectives issued here. Horovod would name an unnamed one after a
        # per-process handle count, which differs between ranks once one of them ran more
        # steps (uneven data), and the ranks would then wait for each other forever.
        self.collectives = 0

    # -- selection --------------------------------------------------------------------------

    @classmethod
    def availability(cls, ctx: SelectionContext) -> Availability:
        if importlib.util.find_spec("horovod") is None:
            return Availability(False, "horovod is not installed", INSTALL)
        try:
            hvd = _hvd()
        except Exception as error:  # a build without PyTorch support fails to import
            return Availability(
                False,
                f"horovod is installed, but horovod.torch cannot be imported ({error}): Horovod "
                f"was built without PyTorch support or against another torch than "
                f"{torch.__version__}",
                INSTALL,
            )
        gloo, mpi = bool(hvd.gloo_built()), bool(hvd.mpi_built())
        if not (gloo or mpi):
            return Availability(
                False,
                "Horovod was built with neither the Gloo nor the MPI controller",
                "rebuild it with HOROVOD_WITH_GLOO=1 (" + INSTALL + ")",
            )
        if not started_by_horovod(ctx) and ctx.num_processes > 1 and not gloo:
            return Availability(
                False,
                f"num_processes={ctx.num_processes} without horovodrun starts the workers "
                "through Horovod's Gloo runner, but this Horovod was built without Gloo",
                "start the job with `horovodrun -np N python train.py` (or mpirun), or rebuild "
                "Horovod with HOROVOD_WITH_GLOO=1",
            )
        gpu_ops = any(
            bool(getattr(hvd, check, lambda: False)())
            for check in ("nccl_built", "cuda_built", "rocm_built")
        )
        if ctx.gpu_ids and not gpu_ops:
            return Availability(
                False,
                f"gpus={ctx.flags.gpus!r} asks for GPUs, but this Horovod was built without GPU "
                "operations",
                "rebuild it with HOROVOD_GPU_OPERATIONS=NCCL, or train on the CPU (unset gpus)",
            )
        controllers = " and ".join(n for n, built in (("Gloo", gloo), ("MPI", mpi)) if built)
        version = getattr(sys.modules.get("horovod"), "__version__", "?")
        return Availability(True, f"Horovod {version} with PyTorch and {controllers}")

    @classmethod
    def resolve(cls, ctx: SelectionContext) -> Resolution:
        if ctx.num_gpus > 1 or ctx.num_nodes > 1:
            flag = f"gpus={ctx.flags.gpus!r}" if ctx.num_gpus > 1 else f"num_nodes={ctx.num_nodes}"
            raise MisconfigurationError(
                f"distributed_backend='horovod' with {flag}: Horovod runs one process per GPU and "
                "takes the number of processes and hosts from its launcher, not from gpus or "
                "num_nodes. Set gpus=1 (every process then uses the GPU of its local rank; "
                "leave gpus unset for the CPU) and num_nodes=1, and start the job with "
                "`horovodrun -np N -H host1:n1,host2:n2 python train.py`; on one machine, "
                "num_processes=N starts N processes without horovodrun."
            )
        notes = []
        if started_by_horovod(ctx):
            size = ctx.cluster.world_size()
            if ctx.num_processes > 1 and ctx.num_processes != size:
                notes.append(
                    f"num_processes={ctx.num_processes} is ignored: horovodrun/mpirun started "
                    f"this job with {size} process(es)."
                )
        elif ctx.gpu_ids and ctx.num_processes > ctx.device_count:
            raise MisconfigurationError(
                f"distributed_backend='horovod' with gpus={ctx.flags.gpus!r} and num_processes="
                f"{ctx.num_processes} puts each process on the GPU of its local rank, but this "
                f"machine has {ctx.device_count} GPU(s). Set num_processes to at most "
                f"{ctx.device_count}."
            )
        resolution = super().resolve(ctx)
        warning = " ".join(notes) or resolution.warning
        return Resolution(resolution.accelerator, warning, resolution.drop_gpus)

    @classmethod
    def processes_per_node(cls, ctx: SelectionContext) -> int:
        if started_by_horovod(ctx):
            return max(ctx.cluster.world_size() // max(ctx.num_nodes, 1), 1)
        return ctx.num_processes

    # -- each rank ------------------------------------------------------------------------

    def setup_process(self, trainer: Trainer) -> None:
        hvd = _hvd()
        hvd.init()
        self.global_rank, self.local_rank = hvd.rank(), hvd.local_rank()
        self.world_size, self.local_world_size = hvd.size(), hvd.local_size()
        if self.selection.gpu_ids:
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        elif self.local_world_size > 1:
            threads = cpu_threads_per_process(self.local_world_size)
            if threads is not None:
                torch.set_num_threads(threads)
        if trainer.flags.sync_batchnorm:
            trainer.model = convert_sync_batchnorm(trainer.model, hvd)
        trainer.model.to(self.device)
        super().setup_process(trainer)
        if self.device.type == "cuda":
            self.precision.check_device()
            self.moves_batches = True
        hvd.broadcast_parameters(trainer.model.state_dict(), root_rank=0)

    def setup_optimizers(self, trainer: Trainer) -> None:
        hvd = _hvd()
        optimization = trainer.optimization
        size = hvd.size()
        if self.scale_lr_by_size and size > 1:
            for optimizer in optimization.optimizers:
                for group in optimizer.param_groups:
                    group["lr"] = group["lr"] * size
                    if "initial_lr" in group:
                        group["initial_lr"] = group["initial_lr"] * size
            for scheduler in optimization.schedulers:
                if getattr(scheduler, "base_lrs", None) is not None:
                    scheduler.base_lrs = [lr * size for lr in scheduler.base_lrs]
            if self.global_rank == 0:
                log.info(
                    "cardcage: horovod multiplied the learning rates by %d processes "
                    "(%s=0 keeps them)",
                    size,
                    SCALE_LR,
                )
        model = self.unwrapped_model(trainer)
        wrapped = {}
        for optimizer in optimization.optimizers:
            broadcast_optimizer(hvd, optimizer, root_rank=0)
            wrapped[id(optimizer)] = hvd.DistributedOptimizer(
                optimizer, named_parameters=named_parameters(model, optimizer)
            )
        # Schedulers move to the wrapper: it starts with the user's parameter-group dicts, but
        # loading a state (resume, the uneven-data broadcast) replaces them.
        for scheduler in optimization.schedulers:
            distributed = wrapped.get(id(getattr(scheduler, "optimizer", None)))
            if distributed is not None:
                scheduler.optimizer = distributed
                track_steps(distributed)
        optimization.optimizers = list(wrapped.values())
        self.distributed_optimizers = list(wrapped.values())

    def backward(self, loss: torch.Tensor) -> None:
        """Backward, then wait for the averaged gradients of every optimizer."""
        self.precision.backward(loss)
        for optimizer in self.distributed_optimizers:
            optimizer.synchronize()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step on the gradients ``backward`` already averaged (through the grad scaler)."""
        skip = getattr(optimizer, "skip_synchronize", None)
        if skip is None:
            self.precision.step(optimizer)
            return
        with skip():
            self.precision.step(optimizer)

    def on_epoch_end(self, trainer: Trainer) -> None:
        """``hvd.join()``, and re-align the ranks if their numbers of batches differed."""
        if self.world_size <= 1:
            return
        hvd = _hvd()
        hvd.join(self.device.index if self.device.type == "cuda" else -1)
        counts = hvd.allgather_object(trainer.batch_idx, name=self.collective("batches"))
        if len(set(counts)) == 1:
            return
        source = counts.index(max(counts))
        hvd.broadcast_parameters(self.unwrapped_model(trainer).state_dict(), root_rank=source)
        for optimizer in self.distributed_optimizers:
            broadcast_optimizer(hvd, optimizer, root_rank=source)
        if self.global_rank == 0 and not self.uneven_warned:
            self.uneven_warned = True
            log.warning(
                "cardcage: the horovod ranks trained on uneven numbers of batches in epoch %d "
                "(%s); hvd.join() let the longer ones finish, and rank %d's weights and "
                "optimizer state were broadcast to all",
                trainer.current_epoch,
                ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts)),
                source,
            )

    def barrier(self, name: str | None = None) -> None:
        if self.world_size > 1 and _initialized():
            _hvd().barrier()

    def broadcast(self, obj: T, src: int = 0) -> T:
        if self.world_size <= 1 or not _initialized():
            return obj
        result: T = _hvd().broadcast_object(obj, root_rank=src, name=self.collective("broadcast"))
        return result

    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        if self.world_size <= 1 or not _initialized():
            return tensor
        hvd = _hvd()
        reduced: torch.Tensor = hvd.allreduce(
            tensor, op=hvd.Average if op == "mean" else hvd.Sum, name=self.collective("reduce")
        )
        return reduced

    def collective(self, kind: str) -> str:
        """A name for the next collective, the same on every rank."""
        self.collectives += 1
        return f"cardcage.{kind}.{self.collectives}"

    # -- processes ------------------------------------------------------------------------

    def make_launcher(self) -> Launcher:
        """In this process when horovodrun started it (or for one process); otherwise
        ``num_processes`` workers through Horovod's Gloo runner."""
        if self.selection.cluster == "horovod" or self.selection.num_processes <= 1:
            return InProcessLauncher(self)
        return HorovodRunLauncher(self)


# -- helpers ----------------------------------------------------------------------------------


def scale_lr_setting(env: Mapping[str, str], default: bool = True) -> bool:
    """Whether to multiply learning rates by ``hvd.size()``: ``CARDCAGE_HOROVOD_SCALE_LR``."""
    raw = env.get(SCALE_LR, "").strip()
    if not raw:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise MisconfigurationError(
        f"environment variable {SCALE_LR}={raw!r} is not valid: set it to 1 to multiply the "
        "learning rates by the number of Horovod processes (the default), or 0 to keep the "
        "learning rates configure_optimizers() set."
    )


def _initialized() -> bool:
    with contextlib.suppress(Exception):
        return bool(_hvd().is_initialized())
    return False


def named_parameters(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` for every parameter ``optimizer`` holds, as Horovod wants them."""
    held = {id(p): p for group in optimizer.param_groups for p in group["params"]}
    named = [(name, p) for name, p in model.named_parameters() if id(p) in held]
    seen = {id(p) for _, p in named}
    named += [(f"unnamed.{i}", p) for i, (key, p) in enumerate(held.items()) if key not in seen]
    return named


def track_steps(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer``'s steps the way a torch LR scheduler marks those of the optimizer it
    was built with, so that its "scheduler stepped before the optimizer" check holds."""
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    @functools.wraps(step)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    tracked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked  # type: ignore[method-assign]


def broadcast_optimizer(hvd: Any, optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Make ``optimizer`` equal to rank ``root_rank``'s: its state, or its hyperparameters
    while it has no state yet (without the zero-gradient step Horovod would take)."""
    if optimizer.state:
        hvd.broadcast_optimizer_state(optimizer, root_rank=root_rank)
        return
    options = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    options = hvd.broadcast_object(options, root_rank=root_rank)
    for group, chosen in zip(optimizer.param_groups, options, strict=True):
        group.update(chosen)


def convert_sync_batchnorm(module: torch.nn.Module, hvd: Any) -> torch.nn.Module:
    """``module`` with every batch-norm layer replaced by ``hvd.SyncBatchNorm``."""
    converted = module
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
        converted = hvd.SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
        )
        converted.load_state_dict(module.state_dict())
        converted.train(module.training)
    for name, child in module.named_children():
        converted.add_module(name, convert_sync_batchnorm(child, hvd))
    return converted


# -- launching workers without horovodrun -------------------------------------------------------


class HorovodRunLauncher(WorkerLauncher):
    """``num_processes`` Horovod workers on this machine through ``horovod.run``.

    A worker that raises leaves its traceback in an error file and exits at once; Horovod's
    runner then stops the others (SIGTERM, SIGKILL after 5 s) and this raises
    :class:`~cardcage.sdk.RankFailedError` naming the rank and its traceback.
    """

    unpicklable_hint = (
        "or start the job with `horovodrun -np N python train.py`, which runs your script in "
        "every process instead"
    )

    def pickle(self, trainer: Trainer) -> bytes:
        """cloudpickle (a Horovod dependency), which writes plain pickle data: tensors are
        copied. Horovod's workers do not run the caller's script, so classes defined there
        (``__main__``) or in a module they could not import by name travel by value."""
        import cloudpickle

        by_value = _modules_by_value(trainer)
        for module in by_value:
            cloudpickle.register_pickle_by_value(module)
        try:
            return pickle_job(
                trainer, cloudpickle.dumps, self.describe(trainer), self.unpicklable_hint
            )
        finally:
            for module in by_value:
                cloudpickle.unregister_pickle_by_value(module)

    def describe(self, trainer: Trainer) -> str:
        return "distributed_backend='horovod' with num_processes > 1"

    def start_workers(self, payload: bytes, folder: Path) -> None:
        import horovod

        count = self.accelerator.selection.num_processes
        gloo = bool(_hvd().gloo_built())
        # horovod.run installs SIGINT/SIGTERM handlers of its own (to stop its workers); they
        # must not outlive the run.
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            horovod.run(
                _worker,
                args=(payload, list(sys.path), str(folder)),
                num_proc=count,
                hosts=f"localhost:{count}",
                use_gloo=gloo,
                use_mpi=not gloo,
                disable_cache=True,  # writes nothing under ~/.horovod
            )
        except Exception as error:
            recorded = first_recorded(folder)
            if recorded is None:
                raise
            code = re.search(r"Exit code: (-?\d+)", str(error))
            raise RankFailedError(
                recorded[0], int(code.group(1)) if code else 1, recorded[1]
            ) from None
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)


def _modules_by_value(trainer: Trainer) -> list[ModuleType]:
    """Modules of the model's and the data's classes that a worker cannot import by name."""
    loaders = [trainer.train_dataloader, *trainer.val_dataloaders]
    objects = [trainer.model, *loaders, *(getattr(loader, "dataset", None) for loader in loaders)]
    found: list[ModuleType] = []
    for obj in objects:
        module = sys.modules.get(type(obj).__module__)
        if module is None or module.__name__ == "__main__" or module in found:
            continue
        top = module.__name__.partition(".")[0]
        if top in sys.builtin_module_names:
            continue
        if importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path]) is None:
            found.append(module)
    return found


def _worker(payload: bytes, path: list[str], folder: str) -> None:  # returns to horovod.run
    """One Horovod worker: train; local rank 0 leaves the results in ``folder``."""
    sys.path.extend(entry for entry in path if entry not in sys.path)
    os.environ[ERROR_FILE] = str(Path(folder) / f"rank-{os.environ.get('HOROVOD_RANK', '0')}.txt")
    try:
        run_worker(payload, folder)
    except BaseException as error:
        # Leave at once: the other ranks are stuck in a collective with this one, and a
        # normal interpreter exit would wait for Horovod's shutdown with them.
        fail(error)


@hookimpl
def cardcage_accelerators() -> list[type[Accelerator]]:
    return [HorovodAccelerator]
