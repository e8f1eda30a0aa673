"""The ddp_spawn backend: DistributedDataParallel in processes started by torch.multiprocessing.

Aliases: ``spawn``, and ``ddp_cpu``, which forces the CPU. It claims jobs with several GPUs
(Lightning 1.0's default, with its warning) and CPU jobs with ``num_processes > 1``. Where a
cluster already created the processes it runs as ``ddp`` in them.
"""

from __future__ import annotations

from cardcage.sdk import (
    Accelerator,
    Availability,
    DistributedAccelerator,
    Resolution,
    Rule,
    SelectionContext,
    SpawnLauncher,
    distributed_availability,
    hookimpl,
)

MULTI_GPU_WARNING = (
    "You requested multiple GPUs but did not specify a backend, e.g. "
    'Trainer(distributed_backend="dp"|"ddp"|"ddp2"). Setting distributed_backend="ddp_spawn" '
    "for you."
)


class DDPSpawnAccelerator(DistributedAccelerator):
    name = "ddp_spawn"
    aliases = ("spawn", "ddp_cpu")
    # Workers started by torch.multiprocessing receive the pickled trainer; rank 0's trained
    # state comes back into the caller's trainer and model.
    launcher = SpawnLauncher
    rules = (
        Rule(
            order=400,
            when=lambda ctx: ctx.num_gpus > 1,
            why="more than one GPU",
            name="multi_gpu",
            warning=MULTI_GPU_WARNING,
        ),
        Rule(
            order=500,
            when=lambda ctx: ctx.num_gpus == 0 and ctx.num_processes > 1,
            why="no GPU and num_processes > 1",
            name="cpu_processes",
        ),
    )

    @classmethod
    def availability(cls, ctx: SelectionContext) -> Availability:
        return distributed_availability()

    @classmethod
    def resolve(cls, ctx: SelectionContext) -> Resolution:
        resolution = super().resolve(ctx)
        notes = []
        drop = ctx.requested_as == "ddp_cpu" and bool(ctx.gpu_ids)
        if drop:
            notes.append(
                "You requested one or more GPUs, but set the backend to `ddp_cpu`. "
                "Training will not use GPUs."
            )
        target = resolution.accelerator
        if ctx.processes_created_outside:
            target = "ddp"
            notes.append(
                f"the {ctx.cluster.name} environment already created the processes, so "
                f"distributed_backend={ctx.requested_as!r} runs as 'ddp' in them."
            )
        return Resolution(target, " ".join(notes) or resolution.warning, drop_gpus=drop)


@hookimpl
def cardcage_accelerators() -> list[type[Accelerator]]:
    return [DDPSpawnAccelerator]
