"""The horovod backend: Horovod's DistributedOptimizer, one process per rank.

Under horovodrun or mpirun (rule 100) each process trains as its Horovod rank; under plain
``python``, ``num_processes=N`` starts N workers through Horovod's Gloo runner and takes rank
0's state back, as ``ddp_spawn`` does. Lightning 1.0's HorovodAccelerator with its bugs fixed
(the README says which, and why); discovery never imports horovod.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar, cast

import torch

from cardcage.sdk import (
    Accelerator,
    Availability,
    InProcessLauncher,
    Launcher,
    MisconfigurationError,
    Resolution,
    Rule,
    Selection,
    SelectionContext,
    TrainerProtocol,
    WorkerLauncher,
    convert_batchnorm,
    env_switch,
    hookimpl,
    import_engine,
    launched_processes_per_node,
    named_parameters,
    run_started_worker,
    share_cpu_threads,
)

log = logging.getLogger("cardcage")
T = TypeVar("T")

# The builder ships here (build.py): Horovod 0.28.1 from pip does not build against torch 2.
INSTALL = (
    "build Horovod for this torch and install it with "
    "`python -m cardcage_horovod.build --install`: Horovod 0.28.1 with the C++17 patch torch 2 "
    "needs, about 5 minutes on 2 cores once, then cached"
)
SCALE_LR = "CARDCAGE_HOROVOD_SCALE_LR"
GPU_BUILDS = ("nccl_built", "cuda_built", "rocm_built")  # any of them: GPU operations


def _hvd() -> Any:
    import horovod.torch as hvd

    return hvd


def started_by_horovod(ctx: SelectionContext) -> bool:
    """Whether horovodrun or mpirun started this process (the horovod cluster environment)."""
    return ctx.cluster.name == "horovod"


def started_elsewhere(ctx: SelectionContext) -> str:
    """Why Horovod cannot run in processes that a launcher other than horovodrun or mpirun
    (torchrun, SLURM's srun, a plugin's scheduler) started, several of them: each would start
    a Horovod job of its own through Horovod's runner. What to run instead."""
    size = ctx.cluster.world_size()
    name = ctx.cluster.name
    if name == "torchelastic":
        under, each, alone = f"torchrun (WORLD_SIZE={size})", "torchrun processes", "python"
        ddp = "under torchrun"
    elif name == "slurm":
        under, each, alone = (
            f"SLURM managing tasks (SLURM_NTASKS={size})",
            "SLURM tasks",
            "srun -n 1 python",
        )
        ddp = "with SLURM starting the tasks"
    else:
        under = f"the cluster environment {name!r}, which started {size} processes"
        each, alone, ddp = f"processes {name!r} started", "python", f"with {name!r} starting them"
    return (
        f"distributed_backend='horovod' under {under}: Horovod takes its processes from its "
        f"own launcher, so each of the {size} {each} would start a Horovod job of its own. "
        f"Start the job with `horovodrun -np {size} python train.py`, or with "
        f"`{alone} train.py` with num_processes={size} (Horovod's runner starts the "
        f"processes); {ddp}, use distributed_backend='ddp'."
    )


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
    #: The default of CARDCAGE_HOROVOD_SCALE_LR: multiply the learning rates, as the seed did.
    scale_lr: ClassVar[bool] = True

    @classmethod
    def check_selection(cls, selection: Selection, env: Mapping[str, str]) -> None:
        """select, the Trainer and ``cardcage explain`` refuse a bad
        CARDCAGE_HOROVOD_SCALE_LR alike, before anything starts."""
        super().check_selection(selection, env)
        scale_lr_setting(env, default=cls.scale_lr)

    def __init__(self, selection: Any):
        super().__init__(selection)
        # Read here too: workers inherit the value the calling process checked.
        self.scale_lr_by_size = scale_lr_setting(os.environ, default=self.scale_lr)
        self.distributed_optimizers: list[Any] = []
        #: id of a DistributedOptimizer -> how many ``skip_gradient_sync`` contexts hold it.
        self.held: dict[int, int] = {}
        # Our own count names the collectives: Horovod's default name counts handles per
        # process, which differ between ranks after uneven data, and the ranks would hang.
        self.collectives = 0

    @classmethod
    def availability(cls, ctx: SelectionContext) -> Availability:
        broken = "Horovod was built without PyTorch or for another torch than " + torch.__version__
        hvd, found = import_engine("horovod.torch", INSTALL, broken)
        if hvd is None:
            return found
        gloo, mpi = bool(hvd.gloo_built()), bool(hvd.mpi_built())
        if not (gloo or mpi):
            why = "Horovod was built with neither the Gloo nor the MPI controller"
            return Availability(False, why, f"rebuild it with HOROVOD_WITH_GLOO=1 ({INSTALL})")
        if not (gloo or started_by_horovod(ctx)) and ctx.num_processes > 1:
            return Availability(
                False,
                f"num_processes={ctx.num_processes} without horovodrun needs a Horovod with Gloo",
                "start the job with `horovodrun -np N python train.py` (or mpirun), or rebuild "
                "Horovod with HOROVOD_WITH_GLOO=1",
            )
        if ctx.gpu_ids and not any(getattr(hvd, built, bool)() for built in GPU_BUILDS):
            return Availability(
                False,
                f"gpus={ctx.flags.gpus!r} asks for GPUs, but this Horovod has no GPU operations",
                "rebuild it with HOROVOD_GPU_OPERATIONS=NCCL, or train on the CPU (unset gpus)",
            )
        controllers = " and ".join(n for n, built in (("Gloo", gloo), ("MPI", mpi)) if built)
        version = getattr(sys.modules.get("horovod"), "__version__", "?")
        return Availability(True, f"Horovod {version} with PyTorch and {controllers}")

    @classmethod
    def resolve(cls, ctx: SelectionContext) -> Resolution:
        """Refuse the process counts Horovod takes from its launcher."""
        if ctx.num_gpus > 1 or ctx.num_nodes > 1:
            flag = f"gpus={ctx.flags.gpus!r}" if ctx.num_gpus > 1 else f"num_nodes={ctx.num_nodes}"
            raise MisconfigurationError(
                f"distributed_backend='horovod' with {flag}: Horovod runs one process per GPU and "
                "takes the number of processes and hosts from its launcher. Set gpus=1 (each "
                "process then uses the GPU of its local rank; unset for the CPU) and num_nodes=1, "
                "and start the job with `horovodrun -np N -H host1:n1,host2:n2 python train.py`; "
                "on one machine, num_processes=N starts N processes without horovodrun."
            )
        if ctx.processes_created_outside and not started_by_horovod(ctx):
            raise MisconfigurationError(started_elsewhere(ctx))
        if ctx.gpu_ids and not started_by_horovod(ctx) and ctx.num_processes > ctx.device_count:
            raise MisconfigurationError(
                f"distributed_backend='horovod' with gpus={ctx.flags.gpus!r} and num_processes="
                f"{ctx.num_processes} puts each process on the GPU of its local rank, but this "
                f"machine has {ctx.device_count} GPU(s). Set num_processes to at most "
                f"{ctx.device_count}."
            )
        return super().resolve(ctx)  # notes a num_processes that horovodrun overrides

    @classmethod
    def processes_per_node(cls, ctx: SelectionContext) -> int:
        """The launcher's count, else ``num_processes`` (with ``gpus=1``, one GPU each)."""
        return launched_processes_per_node(ctx) or ctx.num_processes

    # -- each rank ------------------------------------------------------------------------

    def setup_environment(self) -> None:
        """``hvd.init()``, this rank's device (or share of the cores), the precision."""
        hvd = _hvd()
        hvd.init()
        self.global_rank, self.local_rank = hvd.rank(), hvd.local_rank()
        self.world_size, self.local_world_size = hvd.size(), hvd.local_size()
        if self.selection.gpu_ids:
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
            self.moves_batches = True
        elif self.local_world_size > 1:
            share_cpu_threads(self.local_world_size, self.local_rank)
        super().setup_environment()
        if self.device.type == "cuda":
            self.precision.check_device()

    def setup_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """Horovod's sync batch-norm, placement, precision, and rank 0's weights."""
        if self.selection.flags.sync_batchnorm:
            model = convert_batchnorm(model, _hvd().SyncBatchNorm)
        model.to(self.device)
        model = super().setup_module(model)
        _hvd().broadcast_parameters(model.state_dict(), root_rank=0)
        return model

    def setup_optimizers(self, trainer: TrainerProtocol) -> None:
        """Scale the learning rates (for the Trainer); give each optimizer rank 0's settings
        and Horovod's wrapper.

        Called by the Trainer after ``configure_optimizers`` and by a Cage for the optimizers
        of each ``setup`` (``trainer`` is then a view of the modules set up so far, whose
        parameter names are unique across them, as Horovod's collectives need)."""
        hvd = _hvd()
        if self.scale_lr_by_size and self.world_size > 1 and not self.own_loop:
            trainer.optimization.scale_learning_rates(self.world_size)
            if self.global_rank == 0:
                how = "cardcage: horovod multiplied the learning rates by %d (%s=0 keeps them)"
                log.info(how, self.world_size, SCALE_LR)

        def distributed(optimizer: torch.optim.Optimizer) -> Any:
            broadcast_optimizer(hvd, optimizer, root_rank=0)
            named = named_parameters(self.unwrapped_model(trainer), optimizer)
            # One backward pass per step: the hooks all-reduce each gradient as backward
            # computes it. Accumulation holds them back in skip_gradient_sync instead, for
            # the Trainer's accumulate_grad_batches and a Cage's no_backward_sync alike.
            wrapped = hvd.DistributedOptimizer(
                optimizer, named_parameters=named, backward_passes_per_step=1
            )
            wrapped.state.update(optimizer.state)  # the wrapper is a new optimizer
            type(wrapped).zero_grad = _zero_grad  # a class of its own, made by Horovod
            return wrapped

        self.distributed_optimizers += trainer.optimization.wrap(distributed)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward, then wait for the averaged gradients of every optimizer (but those
        ``skip_gradient_sync`` holds). So the loop's ``clip_gradients`` (the default) clips
        averaged gradients, and ``optimizer_step`` need not synchronize."""
        self.precision.backward(loss)
        for optimizer in self.distributed_optimizers:
            if id(optimizer) not in self.held:
                optimizer.synchronize()

    @contextlib.contextmanager
    def skip_gradient_sync(self) -> Iterator[None]:
        """Backward accumulates gradients without all-reducing them: for the micro-batches
        before the last of the Trainer's accumulated step, and a Cage's
        ``no_backward_sync(module)``.

        Horovod's hooks all-reduce a parameter's gradient when its ``_allreduce_delay`` (the
        backward passes still to come before the step) reaches 0: inside, it is set beyond
        reach, so the hooks only count, and ``backward`` does not ``synchronize`` these
        optimizers; on the way out it is set to 1, so the next backward outside all-reduces
        the accumulated sums once (or ``synchronize``, if the step comes first). Held are the
        optimizers of the module the Cage names (:attr:`parallel`), or, for the Trainer,
        every optimizer."""
        held = self.held_optimizers()
        for optimizer in held:
            count = self.held.get(id(optimizer), 0)
            if count == 0:
                delays = optimizer._allreduce_delay
                for parameter in delays:
                    delays[parameter] = HELD
            self.held[id(optimizer)] = count + 1
        try:
            yield
        finally:
            for optimizer in held:
                count = self.held.pop(id(optimizer)) - 1
                if count:
                    self.held[id(optimizer)] = count
                    continue
                delays = optimizer._allreduce_delay
                for parameter in delays:
                    delays[parameter] = 1

    def held_optimizers(self) -> list[Any]:
        """The DistributedOptimizers ``skip_gradient_sync`` holds: each holding a parameter
        of :attr:`parallel` (the module a Cage's ``no_backward_sync`` names), or all."""
        if self.parallel is None:
            return list(self.distributed_optimizers)
        mine = {id(p) for p in self.parallel.parameters()}
        return [
            optimizer
            for optimizer in self.distributed_optimizers
            if any(id(p) in mine for p in optimizer._allreduce_delay)
        ]

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step on the gradients ``backward`` already averaged (through the grad scaler).
        Gradients still held back (a step right after a backward inside
        ``no_backward_sync``) are all-reduced first, as Horovod's own step would."""
        skip = getattr(optimizer, "skip_synchronize", None)
        if skip is not None and getattr(optimizer, "_handles", None):
            optimizer.synchronize()  # type: ignore[attr-defined]
        with skip() if skip is not None else contextlib.nullcontext():
            self.precision.step(optimizer)

    joins_uneven_batches = True  # on_epoch_end's hvd.join(): uneven loaders end, not hang

    def on_epoch_end(self, trainer: TrainerProtocol) -> None:
        """``hvd.join()``: ranks out of batches serve the others' allreduces with zeros
        instead of hanging; then all continue from the rank that trained the most."""
        if self.world_size <= 1:
            return
        hvd = _hvd()
        hvd.join(self.device.index if self.device.type == "cuda" else -1)
        counts = hvd.allgather_object(trainer.batch_idx, name=self.collective("batches"))
        source = self.uneven_source(trainer.current_epoch, counts)
        if source is not None:
            hvd.broadcast_parameters(self.unwrapped_model(trainer).state_dict(), root_rank=source)
            for optimizer in self.distributed_optimizers:
                broadcast_optimizer(hvd, optimizer, root_rank=source)

    def teardown(self, trainer: TrainerProtocol) -> None:
        """Drop the gradient hooks of this fit's DistributedOptimizers, which Horovod cannot
        remove: a later fit of the same parameters here would allreduce each one twice."""
        for optimizer in self.distributed_optimizers:
            optimizer._grad_accs.clear()
        self.distributed_optimizers = []
        self.held = {}

    def barrier(self, name: str | None = None) -> None:
        if self.world_size > 1 and _hvd().is_initialized():
            _hvd().barrier()

    def broadcast(self, obj: T, src: int = 0) -> T:
        if self.world_size <= 1 or not _hvd().is_initialized():
            return obj
        name = self.collective("broadcast")
        return cast(T, _hvd().broadcast_object(obj, root_rank=src, name=name))

    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        if self.world_size <= 1 or not _hvd().is_initialized():
            return tensor
        hvd = _hvd()
        kind = hvd.Average if op == "mean" else hvd.Sum
        return cast(torch.Tensor, hvd.allreduce(tensor, op=kind, name=self.collective("reduce")))

    def collective(self, kind: str) -> str:
        """A name for the next collective, the same on every rank."""
        self.collectives += 1
        return f"cardcage.{kind}.{self.collectives}"

    def make_launcher(self) -> Launcher:
        """Here under horovodrun (or for one process), else workers through ``horovod.run``."""
        if self.selection.cluster == "horovod" or self.selection.num_processes <= 1:
            return InProcessLauncher(self)
        return HorovodRunLauncher(self)


#: ``_allreduce_delay`` of a held parameter: more backward passes than any step takes.
HELD = sys.maxsize


def _zero_grad(self: Any, set_to_none: bool = True) -> None:
    """``zero_grad`` for a Horovod ``DistributedOptimizer``, whose own takes no
    ``set_to_none`` (a Cage's optimizer passes it on): Horovod's check, then the optimizer
    class's ``zero_grad``."""
    if self._handles:
        raise AssertionError(
            "optimizer.zero_grad() was called after loss.backward() but before "
            "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
            "cause a race condition."
        )
    super(type(self), self).zero_grad(set_to_none=set_to_none)


def scale_lr_setting(env: Mapping[str, str], default: bool = True) -> bool:
    """Whether to multiply learning rates by ``hvd.size()``: ``CARDCAGE_HOROVOD_SCALE_LR``."""
    on = "multiply the learning rates by the number of Horovod processes (the default)"
    return env_switch(env, SCALE_LR, default, on, "keep the rates configure_optimizers() set")


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


class HorovodRunLauncher(WorkerLauncher):
    """``num_processes`` Horovod workers on this machine through ``horovod.run``. They do not
    run the caller's script, so the trainer goes by cloudpickle. A worker that raises records
    its traceback and exits at once; Horovod's runner then stops the others."""

    pickle_by_value = True
    unpicklable_hint = (
        "or start the job with `horovodrun -np N python train.py`, which runs your script in "
        "every process instead"
    )

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
