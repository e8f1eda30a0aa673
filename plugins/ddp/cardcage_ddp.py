"""The ddp backend: DistributedDataParallel with one process per device.

Processes come from a relaunch of the user's script on this node (this process trains as
local rank 0 and re-runs the script for the others, as Lightning 1.0 did), or from a
cluster that already created them (torchrun/torchelastic, SLURM). It claims every
multi-node job and every job whose processes a cluster created.
"""

from __future__ import annotations

from cardcage.sdk import (
    Accelerator,
    Availability,
    DistributedAccelerator,
    Resolution,
    Rule,
    SelectionContext,
    distributed_availability,
    hookimpl,
)


class DDPAccelerator(DistributedAccelerator):
    name = "ddp"
    rules = (
        Rule(
            order=300,
            when=lambda ctx: ctx.num_nodes > 1 or ctx.processes_created_outside,
            why="num_nodes > 1, or a cluster (torchelastic, SLURM, mpirun) created the processes",
            name="multi_node_or_cluster",
        ),
    )

    @classmethod
    def availability(cls, ctx: SelectionContext) -> Availability:
        return distributed_availability()

    @classmethod
    def resolve(cls, ctx: SelectionContext) -> Resolution:
        resolution = super().resolve(ctx)
        lone = ctx.num_processes == 1 and ctx.num_nodes == 1 and not ctx.gpu_ids
        if lone and not ctx.processes_created_outside:
            return Resolution(
                "cpu",
                "distributed_backend='ddp' with one CPU process on one node has nothing to "
                "distribute: training on the CPU in this process. Set num_processes (or "
                "gpus, or num_nodes) to train with several processes.",
            )
        return resolution

    # Training: DistributedAccelerator's launcher relaunches the script, or joins the
    # processes a cluster made; its setup_process trains one rank per process.


@hookimpl
def cardcage_accelerators() -> list[type[Accelerator]]:
    return [DDPAccelerator]
