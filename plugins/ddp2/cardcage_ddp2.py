"""The ddp2 backend: one process per node, DataParallel across that node's GPUs, gradients
averaged across nodes. Only ever chosen by name.

With no GPU on a single node it hands the job to the CPU (as Lightning 1.0 did); with no GPU
on several nodes it still runs one CPU process per node.
"""

from __future__ import annotations

import cardcage
from cardcage import Accelerator, Availability, Resolution, SelectionContext
from cardcage.accelerator import cuda_availability


class DDP2Accelerator(Accelerator):
    name = "ddp2"
    rules = ()

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


@cardcage.hookimpl
def cardcage_accelerators() -> list[type[Accelerator]]:
    return [DDP2Accelerator]
