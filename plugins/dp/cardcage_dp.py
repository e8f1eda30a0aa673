"""The dp backend: one process, ``torch.nn.DataParallel`` across the GPUs of one node."""

from __future__ import annotations

import cardcage
from cardcage import Accelerator, Availability, SelectionContext
from cardcage.accelerator import cuda_availability


class DataParallelAccelerator(Accelerator):
    name = "dp"
    multi_node = False
    needs_gpus = True
    rules = ()  # DataParallel is only ever chosen by name

    @classmethod
    def availability(cls, ctx: SelectionContext) -> Availability:
        return cuda_availability(ctx)

    @classmethod
    def processes_per_node(cls, ctx: SelectionContext) -> int:
        return 1


@cardcage.hookimpl
def cardcage_accelerators() -> list[type[Accelerator]]:
    return [DataParallelAccelerator]
