"""The fsdp backend: sharded data parallel on FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each rank holds a shard of every parameter, gradient and optimizer state, and all-gathers a
module's parameters just for its forward and backward: less memory per rank than ``ddp``,
for more communication. What each rank does is the SDK's :class:`ShardedAccelerator`; this
plugin gives it its names and its processes: ``fsdp`` starts them as ``ddp`` does (script
relaunch, or a cluster's: torchrun, SLURM), and ``fsdp_spawn`` by torch.multiprocessing. No
rule claims a job: name it. Written only against ``cardcage.sdk``, as a third-party backend
would be; the README says why each choice was made.
"""

from __future__ import annotations

from cardcage.sdk import (
    Accelerator,
    Resolution,
    SelectionContext,
    ShardedAccelerator,
    SpawnLauncher,
    hookimpl,
)


class FSDPAccelerator(ShardedAccelerator):
    name = "fsdp"
    rules = ()  # selected by name only: sharding is a choice of memory over speed

    @classmethod
    def resolve(cls, ctx: SelectionContext) -> Resolution:
        resolution = super().resolve(ctx)
        if ctx.processes_created_outside and resolution.accelerator != "fsdp":
            note = f"the {ctx.cluster.name} environment already created the processes, so "
            note += f"distributed_backend={ctx.requested_as!r} runs as 'fsdp' in them."
            return Resolution("fsdp", note)
        return resolution

    # Training: ShardedAccelerator's, in the processes DistributedAccelerator's launcher
    # makes (a relaunch of the script, or those a cluster made).


class FSDPSpawnAccelerator(FSDPAccelerator):
    """``fsdp`` in processes started by torch.multiprocessing; rank 0's state comes back."""

    name = "fsdp_spawn"
    launcher = SpawnLauncher


@hookimpl
def cardcage_accelerators() -> list[type[Accelerator]]:
    return [FSDPAccelerator, FSDPSpawnAccelerator]
