"""The horovod backend: Horovod's DistributedOptimizer in processes started by horovodrun/mpirun.

Discovery never imports horovod: ``availability`` looks for the module first and imports
``horovod.torch`` only when asked whether it can run.
"""

from __future__ import annotations

import importlib.util

import cardcage
from cardcage import Accelerator, Availability, Resolution, Rule, SelectionContext
from cardcage.errors import MisconfigurationError

INSTALL = "HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 pip install 'cardcage[horovod]'"


class HorovodAccelerator(Accelerator):
    name = "horovod"
    rules = (
        Rule(
            order=100,
            when=lambda ctx: ctx.cluster.name == "horovod",
            why="the process was started by horovodrun or mpirun",
            name="horovodrun",
        ),
    )

    @classmethod
    def availability(cls, ctx: SelectionContext) -> Availability:
        if importlib.util.find_spec("horovod") is None:
            return Availability(False, "horovod is not installed", INSTALL)
        try:
            import horovod.torch as hvd
        except Exception as error:  # a build without PyTorch support fails to import
            return Availability(
                False,
                f"horovod.torch cannot be imported ({error}): Horovod was built "
                "without PyTorch support or against another torch",
                INSTALL,
            )
        if not (hvd.gloo_built() or hvd.mpi_built()):
            return Availability(False, "Horovod was built with neither Gloo nor MPI", INSTALL)
        return Availability(True)

    @classmethod
    def resolve(cls, ctx: SelectionContext) -> Resolution:
        if ctx.num_gpus > 1 or ctx.num_nodes > 1:
            flag = f"gpus={ctx.flags.gpus!r}" if ctx.num_gpus > 1 else f"num_nodes={ctx.num_nodes}"
            raise MisconfigurationError(
                f"distributed_backend='horovod' with {flag}: Horovod takes the number of "
                "processes from its launcher, one GPU each. Set gpus=1 (or leave it unset "
                "for the CPU) and num_nodes=1, and start the job with "
                "`horovodrun -np N -H host1:n,host2:n python train.py`."
            )
        return super().resolve(ctx)

    @classmethod
    def processes_per_node(cls, ctx: SelectionContext) -> int:
        if ctx.cluster.name == "horovod":
            return max(ctx.cluster.world_size() // max(ctx.num_nodes, 1), 1)
        return ctx.num_processes


@cardcage.hookimpl
def cardcage_accelerators() -> list[type[Accelerator]]:
    return [HorovodAccelerator]
