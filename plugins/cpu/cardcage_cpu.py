"""The cpu backend: one process on the CPU, and the fallback when no other rule claims a job."""

from __future__ import annotations

from cardcage.sdk import Accelerator, Availability, Resolution, Rule, SelectionContext, hookimpl


class CPUAccelerator(Accelerator):
    name = "cpu"
    multi_node = False
    rules = (
        Rule(order=1000, when=lambda ctx: True, why="the CPU is always there", name="cpu_fallback"),
    )

    @classmethod
    def availability(cls, ctx: SelectionContext) -> Availability:
        return Availability(True)

    @classmethod
    def resolve(cls, ctx: SelectionContext) -> Resolution:
        resolution = super().resolve(ctx)
        notes = []
        if ctx.num_processes > 1:
            notes.append(
                f"num_processes={ctx.num_processes} is ignored by distributed_backend='cpu', "
                "which trains in one process; use distributed_backend='ddp_cpu' for several."
            )
        if ctx.gpu_ids and ctx.requested == cls.name:
            notes.append(
                f"gpus={ctx.flags.gpus!r} is ignored by distributed_backend='cpu'. Unset "
                "distributed_backend to train on the GPUs."
            )
        warning = " ".join(notes) or resolution.warning
        return Resolution(resolution.accelerator, warning, drop_gpus=bool(ctx.gpu_ids))

    @classmethod
    def processes_per_node(cls, ctx: SelectionContext) -> int:
        return 1


@hookimpl
def cardcage_accelerators() -> list[type[Accelerator]]:
    return [CPUAccelerator]
