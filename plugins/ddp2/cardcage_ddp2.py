"""The ddp2 backend: one process per node, DataParallel across that node's GPUs, gradients
averaged across nodes before each optimizer step. Only ever chosen by name.

Lightning 1.0 built ddp2 on single-process multi-device DistributedDataParallel, which
torch has since removed. Here each node's process runs the step in DataParallel replicas
(the batch is split over the node's GPUs, outputs gathered and reduced on the root GPU, as
with ``dp``), and after backward the gradients are averaged over the nodes with one
all-reduce. The data is sharded per node. With no GPU on a single node it hands the job to
the CPU (as Lightning 1.0 did); with no GPU on several nodes each node trains one CPU process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from cardcage.sdk import (
    Accelerator,
    Availability,
    DistributedAccelerator,
    Resolution,
    SelectionContext,
    StepRunner,
    broadcast_from_rank_zero,
    cuda_availability,
    data_parallel_step,
    hookimpl,
)


class DDP2Accelerator(DistributedAccelerator):
    name = "ddp2"
    rules = ()

    def __init__(self, selection: Any):
        super().__init__(selection)
        #: The modules :meth:`wrap` set up in this process (the Trainer's model, or each one
        #: a Cage set up): backward averages their gradients.
        self.wrapped: list[torch.nn.Module] = []
        #: How many ``skip_gradient_sync`` contexts are open: backward does not average.
        self.accumulating = 0

    @classmethod
    def availability(cls, ctx: SelectionContext) -> Availability:
        if not ctx.gpu_ids and ctx.num_nodes > 1:
            return Availability(True, "no GPU requested: one CPU process per node")
        return cuda_availability(ctx)

    @classmethod
    def resolve(cls, ctx: SelectionContext) -> Resolution:
        resolution = super().resolve(ctx)
        if ctx.gpu_ids:
            return resolution
        if ctx.num_nodes == 1:
            return Resolution(
                cls.cpu_fallback,
                f"distributed_backend='ddp2' needs GPUs, but gpus={ctx.flags.gpus!r} "
                "requests none: training on the CPU instead. Set gpus to use GPUs.",
            )
        return Resolution(
            cls.name,
            f"distributed_backend='ddp2' with no GPU: each of the {ctx.num_nodes} nodes "
            "trains one process on the CPU.",
        )

    @classmethod
    def processes_per_node(cls, ctx: SelectionContext) -> int:
        return 1

    def device_for_rank(self) -> torch.device:
        gpu_ids = self.selection.gpu_ids
        return torch.device("cuda", gpu_ids[0]) if gpu_ids else torch.device("cpu")

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Every node starts from rank 0's weights, then runs DataParallel replicas (GPUs)
        or the model itself (CPU). No DistributedDataParallel here, so no constructor
        broadcasts rank 0's parameters and buffers: ``broadcast_from_rank_zero`` does."""
        broadcast_from_rank_zero(model)
        self.wrapped.append(model)
        runner = StepRunner(model, self.precision.autocast)
        gpu_ids = self.selection.gpu_ids
        return torch.nn.DataParallel(runner, device_ids=gpu_ids) if gpu_ids else runner

    def step_function(self, model: torch.nn.Module, name: str) -> Callable[..., Any]:
        if self.selection.gpu_ids and self.parallel is not None:
            return data_parallel_step(self.parallel, model, name)
        return (
            super().step_function(model, name)
            if name != "training_step"
            else (getattr(model, name))
        )

    def backward(self, loss: torch.Tensor) -> None:
        super().backward(loss)
        if self.world_size > 1 and dist.is_initialized() and not self.accumulating:
            self._average_gradients()

    @contextlib.contextmanager
    def skip_gradient_sync(self) -> Iterator[None]:
        """Backward leaves the nodes' gradients apart (summed locally) until the last
        micro-batch of an accumulated step (or a Cage's next backward outside
        ``no_backward_sync``), whose backward averages the whole sum once: the average of
        sums is the sum of averages."""
        self.accumulating += 1
        try:
            yield
        finally:
            self.accumulating -= 1

    def _average_gradients(self) -> None:
        """One all-reduce of every gradient, flattened, divided by the number of nodes."""
        grads = [p.grad for p in self.parallel_parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= self.world_size
        pieces = torch.split(flat, [grad.numel() for grad in grads])
        for grad, averaged in zip(grads, pieces, strict=True):
            grad.copy_(averaged.view_as(grad))

    def parallel_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters of every module set up in this process, each once, in set-up
        order (the same on every node)."""
        seen: set[int] = set()
        found = []
        for module in self.wrapped:
            for parameter in module.parameters():
                if id(parameter) not in seen:
                    seen.add(id(parameter))
                    found.append(parameter)
        return found

    def teardown(self, trainer: Any) -> None:
        """Forget this job's modules (a later job in this process sets up its own)."""
        self.wrapped = []
        super().teardown(trainer)


@hookimpl
def cardcage_accelerators() -> list[type[Accelerator]]:
    return [DDP2Accelerator]
