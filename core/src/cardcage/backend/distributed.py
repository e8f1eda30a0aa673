"""What every torch.distributed backend does in each of its processes.

:class:`DistributedAccelerator` joins the process group (gloo on the CPU, NCCL on GPUs),
places the model on this rank's device, wraps it in DistributedDataParallel (whose
construction broadcasts rank 0's weights, so every rank starts identical), shards the data
with a ``DistributedSampler`` that keeps the user's loader settings, and implements barrier,
broadcast and reduce. The ``ddp``, ``ddp_spawn`` and ``ddp2`` plugins subclass it and differ
only in how their processes come to exist; a third-party backend may subclass it too.
"""

from __future__ import annotations

import contextlib
import logging
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
import torch.distributed as dist

from cardcage.backend.accelerator import Accelerator
from cardcage.backend.launch import error_files, rendezvous, watchdog
from cardcage.backend.launch.launcher import Launcher, ScriptLauncher
from cardcage.backend.strategy import group_exit
from cardcage.backend.strategy.samplers import distributed_loader
from cardcage.backend.strategy.step_runner import CALL, StepRunner
from cardcage.config import variables
from cardcage.config.model_contract import takes_optimizer_idx

if TYPE_CHECKING:
    from collections.abc import Callable

    from cardcage.config.flags import Flags


__all__ = [
    "DistributedAccelerator",
    "broadcast_from_rank_zero",
    "cpu_threads_per_process",
    "distributed_loader",
    "finds_unused_parameters",
    "share_cpu_threads",
]

log = logging.getLogger("cardcage")
T = TypeVar("T")


def cpu_threads_per_process(local_world_size: int) -> int | None:
    """Each local process's share of the cores, unless the user set ``OMP_NUM_THREADS``."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, (os.cpu_count() or 1) // max(local_world_size, 1))


def share_cpu_threads(local_world_size: int, local_rank: int) -> None:
    """Give this process its share of the cores as torch threads (``torch.set_num_threads``),
    so that the processes of a node do not oversubscribe them; with ``OMP_NUM_THREADS`` set,
    leave the user's choice. Local rank 0 logs the share."""
    threads = cpu_threads_per_process(local_world_size)
    if threads is None:
        return
    torch.set_num_threads(threads)
    if local_rank == 0:
        log.info(
            "cardcage: %d torch thread(s) per process (%d cores, %d local processes); set "
            "OMP_NUM_THREADS to choose",
            threads,
            os.cpu_count() or 1,
            local_world_size,
        )


def finds_unused_parameters(flags: Flags, model: torch.nn.Module) -> bool:
    """DistributedDataParallel's ``find_unused_parameters``: the flag, or when it is None,
    True for a model stepped once per optimizer (``training_step`` takes ``optimizer_idx``:
    each optimizer's turn leaves the others' parameters without gradients), as Lightning 1.0
    set it; otherwise False, which costs nothing a step."""
    if flags.find_unused_parameters is not None:
        return flags.find_unused_parameters
    return takes_optimizer_idx(model)


def broadcast_from_rank_zero(module: torch.nn.Module) -> None:
    """Give every rank rank 0's parameters and buffers, as DistributedDataParallel's
    constructor does: each process built its own model, perhaps from another seed. A backend
    whose ``wrap`` does not build DDP (a sharding engine, DataParallel per node) calls it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=0)


class DistributedAccelerator(Accelerator):
    """Base of backends that train one torch.distributed rank per process."""

    #: ``None`` picks NCCL for CUDA devices and gloo otherwise.
    process_group_backend: ClassVar[str | None] = None
    needs_rendezvous: ClassVar[bool] = True
    #: Script relaunch, or the processes a cluster made; ddp_spawn uses workers instead.
    launcher: ClassVar[type[Launcher]] = ScriptLauncher

    def __init__(self, selection: Any):
        super().__init__(selection)
        self.local_world_size = selection.num_processes

    # -- process identity -----------------------------------------------------------------

    def read_rank_environment(self) -> None:
        """Take this process's ranks from the launcher's variables when it set them."""
        env = os.environ
        if "RANK" in env and "WORLD_SIZE" in env:
            self.global_rank = int(env["RANK"])
            self.world_size = int(env["WORLD_SIZE"])
            self.local_rank = int(env.get("LOCAL_RANK", "0"))
            self.local_world_size = int(env.get("LOCAL_WORLD_SIZE", self.local_world_size))

    def device_for_rank(self) -> torch.device:
        gpu_ids = self.selection.gpu_ids
        if gpu_ids:
            return torch.device("cuda", gpu_ids[self.local_rank % len(gpu_ids)])
        return torch.device("cpu")

    # -- setup ----------------------------------------------------------------------------

    def init_process_group(self) -> None:
        """Join the job's process group (once per process)."""
        if dist.is_initialized():
            return
        backend = self.process_group_backend or ("nccl" if self.device.type == "cuda" else "gloo")
        timeout = timedelta(seconds=variables.init_timeout())
        address = os.environ.get("MASTER_ADDR") or self.selection.master_address or "127.0.0.1"
        port = os.environ.get("MASTER_PORT") or str(self.selection.master_port or "")
        store = rendezvous.hosted_store()
        loopback = rendezvous.loopback_interface()
        if backend == "gloo" and self.world_size == self.local_world_size and loopback:
            # One node: gloo listens on loopback, not on the address the hostname has.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
        before = group_exit.threads()
        if store is None and os.environ.get(rendezvous.HOSTED_STORE) == "1":
            from torch.distributed import TCPStore  # type: ignore[attr-defined]

            store = TCPStore(address, int(port), is_master=False, timeout=timeout)
        elif store is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent keeps its store across --max-restarts, and torch's env://
            # reuses its keys: a restarted rank may read a dead rank's address from the
            # attempt before (gloo: "connectFullMesh failed ... Connection refused"). A key
            # space per attempt.
            from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            client = TCPStore(address, int(port), is_master=False, timeout=timeout)
            store = PrefixStore(f"/cardcage/attempt_{attempt}", client)
        if store is not None:
            store.set(rendezvous.arrival_key(self.global_rank), str(os.getpid()))
            dist.init_process_group(
                backend,
                store=store,
                rank=self.global_rank,
                world_size=self.world_size,
                timeout=timeout,
            )
        else:
            if not port:
                raise RuntimeError("no MASTER_PORT for the process group")
            os.environ.setdefault("MASTER_ADDR", address)
            os.environ.setdefault("MASTER_PORT", port)
            dist.init_process_group(
                backend,
                init_method="env://",
                rank=self.global_rank,
                world_size=self.world_size,
                timeout=timeout,
            )
        # The rendezvous may take CARDCAGE_INIT_TIMEOUT; a collective waits a little longer
        # than CARDCAGE_TIMEOUT, so that the launcher's watcher names a stuck rank first.
        with contextlib.suppress(AttributeError, ValueError, RuntimeError):
            _set_pg_timeout = dist.distributed_c10d._set_pg_timeout  # no public API for this
            _set_pg_timeout(watchdog.collective_timeout())
        if backend == "gloo":
            # Gloo's threads must be done before the interpreter finalizes (see group_exit.py).
            group_exit.register(group_exit.threads() - before)
        # Where no launcher watches (torchrun), a peer that finds this rank gone names it.
        error_files.join(store, self.global_rank, self.world_size)
        log.info(
            "cardcage: rank %d of %d joined the %s process group",
            self.global_rank,
            self.world_size,
            backend,
        )

    def setup_environment(self) -> None:
        """Ranks from the launcher, the device, threads, the process group, the precision."""
        self.read_rank_environment()
        self.device = self.device_for_rank()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            self.moves_batches = True
        else:
            share_cpu_threads(self.local_world_size, self.local_rank)
        self.init_process_group()
        super().setup_environment()
        if self.device.type == "cuda":
            self.precision.check_device()

    def setup_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """Sync batch-norm, placement, precision, then :meth:`wrap`."""
        if self.selection.flags.sync_batchnorm:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)  # type: ignore[no-untyped-call]
        model.to(self.device)
        model = super().setup_module(model)
        return self.wrap(model)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module whose forward runs a step and synchronises gradients.

        DistributedDataParallel's constructor gives every rank rank 0's weights; an override
        that builds no DDP calls :func:`broadcast_from_rank_zero` itself."""
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(
            StepRunner(model, self.precision.autocast),
            device_ids=device_ids,
            find_unused_parameters=finds_unused_parameters(self.selection.flags, model),
        )

    # -- the loop's calls -------------------------------------------------------------------

    def step_function(self, model: torch.nn.Module, name: str) -> Callable[..., Any]:
        parallel = self.parallel
        if name not in ("training_step", CALL) or parallel is None:
            return super().step_function(model, name)  # no gradients to synchronise

        def step(*args: Any, **kwargs: Any) -> Any:
            return parallel(name, *args, **kwargs)

        return step

    def skip_gradient_sync(self) -> contextlib.AbstractContextManager[None]:
        """DistributedDataParallel's ``no_sync()``: the micro-batches before the last of an
        accumulated step add to local gradients with no all-reduce; the last one's backward
        all-reduces the sum. A ``wrap`` that builds no DDP overrides this if it communicates
        in backward."""
        from torch.nn.parallel import DistributedDataParallel

        parallel = self.parallel
        if isinstance(parallel, DistributedDataParallel):
            return parallel.no_sync()
        return contextlib.nullcontext()

    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: T, src: int = 0) -> T:
        if not dist.is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=src)
        return holder[0]

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if not dist.is_initialized():
            return tensor.unsqueeze(0)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts)

    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        if not dist.is_initialized():
            return tensor
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor / self.world_size if op == "mean" else tensor
