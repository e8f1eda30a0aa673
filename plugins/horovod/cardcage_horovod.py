"""The horovod backend: Horovod's DistributedOptimizer, one process per rank.

Started by horovodrun or mpirun (rule 100), every process trains as its Horovod rank. Under
plain ``python``, ``Trainer(distributed_backend="horovod", num_processes=N)`` starts the N
workers itself through Horovod's Gloo runner (``horovod.run``) and takes rank 0's state back,
as ``ddp_spawn`` does; ``num_processes=1`` trains in the calling process.

Each rank is Lightning 1.0's HorovodAccelerator with its bugs fixed: rank 0's weights and
optimizers broadcast without Horovod's zero-gradient step, the learning rates multiplied by
``hvd.size()`` (``CARDCAGE_HOROVOD_SCALE_LR=0`` keeps them), gradients averaged right after
``backward`` so that ``on_after_backward`` sees them, and ``hvd.join()`` at every epoch's end
for ranks with uneven data. The README says why each of these is done the way it is.
Discovery never imports horovod.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from cardcage.sdk import (
    Accelerator,
    Availability,
    InProcessLauncher,
    Launcher,
    MisconfigurationError,
    Resolution,
    Rule,
    SelectionContext,
    Trainer,
    WorkerLauncher,
    convert_batchnorm,
    env_switch,
    hookimpl,
    import_engine,
    run_started_worker,
    share_cpu_threads,
)

log = logging.getLogger("cardcage")
T = TypeVar("T")

INSTALL = (
    "build Horovod for this torch with `python plugins/horovod/build_horovod.py --install` from "
    "the cardcage repository (Horovod 0.28.1 needs a C++17 patch for torch 2), or "
    "HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 pip install 'cardcage[horovod]'"
)
SCALE_LR = "CARDCAGE_HOROVOD_SCALE_LR"


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
        hvd, found = import_engine(
            "horovod.torch",
            INSTALL,
            "Horovod was built without PyTorch support or against another torch than "
            + torch.__version__,
        )
        if hvd is None:
            return found
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
        """``hvd.init()``, this rank's device (or share of the cores), rank 0's weights."""
        hvd = _hvd()
        hvd.init()
        self.global_rank, self.local_rank = hvd.rank(), hvd.local_rank()
        self.world_size, self.local_world_size = hvd.size(), hvd.local_size()
        if self.selection.gpu_ids:
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        elif self.local_world_size > 1:
            share_cpu_threads(self.local_world_size, self.local_rank)
        if trainer.flags.sync_batchnorm:
            trainer.model = convert_batchnorm(trainer.model, hvd.SyncBatchNorm)
        trainer.model.to(self.device)
        super().setup_process(trainer)
        if self.device.type == "cuda":
            self.precision.check_device()
            self.moves_batches = True
        hvd.broadcast_parameters(trainer.model.state_dict(), root_rank=0)

    def setup_optimizers(self, trainer: Trainer) -> None:
        """Scale the learning rates, then give every optimizer rank 0's settings and wrap
        it in ``hvd.DistributedOptimizer`` (its schedulers follow it)."""
        hvd = _hvd()
        size = hvd.size()
        if self.scale_lr_by_size and size > 1:
            trainer.optimization.scale_learning_rates(size)
            if self.global_rank == 0:
                log.info(
                    "cardcage: horovod multiplied the learning rates by %d processes (%s=0 "
                    "keeps them)",
                    size,
                    SCALE_LR,
                )
        model = self.unwrapped_model(trainer)

        def distributed(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
            broadcast_optimizer(hvd, optimizer, root_rank=0)
            named = named_parameters(model, optimizer)
            wrapped: torch.optim.Optimizer = hvd.DistributedOptimizer(
                optimizer, named_parameters=named
            )
            return wrapped

        self.distributed_optimizers = trainer.optimization.wrap(distributed)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward, then wait for the averaged gradients of every optimizer."""
        self.precision.backward(loss)
        for optimizer in self.distributed_optimizers:
            optimizer.synchronize()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step on the gradients ``backward`` already averaged (through the grad scaler)."""
        skip = getattr(optimizer, "skip_synchronize", None)
        with skip() if skip is not None else contextlib.nullcontext():
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

    def teardown(self, trainer: Trainer) -> None:
        """Drop the gradient hooks of this fit's DistributedOptimizers. Horovod keeps no
        handle to remove them, so they live as long as the gradient nodes it holds; a later
        fit of the same parameters in this process (under horovodrun) would otherwise
        allreduce every gradient twice under one name."""
        for optimizer in self.distributed_optimizers:
            optimizer._grad_accs.clear()
        self.distributed_optimizers = []

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
    on = "multiply the learning rates by the number of Horovod processes (the default)"
    off = "keep the learning rates configure_optimizers() set"
    return env_switch(env, SCALE_LR, default, on, off)


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


# -- launching workers without horovodrun -------------------------------------------------------


class HorovodRunLauncher(WorkerLauncher):
    """``num_processes`` Horovod workers on this machine through ``horovod.run``.

    The workers do not run the caller's script: the trainer travels by cloudpickle, classes
    of ``__main__`` and of modules they cannot import by name by value. A worker that raises
    records its traceback and exits at once; Horovod's runner then stops the others.
    """

    pickle_by_value = True
    unpicklable_hint = (
        "or start the job with `horovodrun -np N python train.py`, which runs your script in "
        "every process instead"
    )

    def describe(self, trainer: Trainer) -> str:
        return "distributed_backend='horovod' with num_processes > 1"

    def exit_code(self, error: Exception) -> int:
        """The failed worker's exit status, as Horovod's runner reports it."""
        code = re.search(r"Exit code: (-?\d+)", str(error))
        return int(code.group(1)) if code else 1

    def start_workers(self, payload: bytes, folder: Path) -> None:
        import horovod

        count = self.accelerator.selection.num_processes
        gloo = bool(_hvd().gloo_built())
        horovod.run(
            run_started_worker,  # local rank 0 leaves the results in folder
            args=(payload, str(folder), list(sys.path), "HOROVOD_RANK"),
            num_proc=count,
            hosts=f"localhost:{count}",
            use_gloo=gloo,
            use_mpi=not gloo,
            disable_cache=True,  # writes nothing under ~/.horovod
        )


@hookimpl
def cardcage_accelerators() -> list[type[Accelerator]]:
    return [HorovodAccelerator]
