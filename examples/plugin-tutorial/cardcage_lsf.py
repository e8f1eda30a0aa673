"""The lsf backend: DistributedDataParallel in the processes ``jsrun`` starts on IBM LSF.

On an LSF cluster, ``jsrun`` (the job step manager) starts one process per rank and tells
each its place through ``JSM_NAMESPACE_*`` variables; LSF lists the job's hosts in the rank
file named by ``LSB_DJOB_RANKFILE``. This plugin registers two things:

- ``LSFEnvironment``, a cluster environment that reads those variables, so that every
  backend sees the right ranks, world size and rendezvous address;
- ``LSFAccelerator``, the backend ``lsf`` (alias ``jsrun``): the core's
  DistributedDataParallel machinery, the one the ``ddp`` backend uses, with its own rule
  that claims every job ``jsrun`` started, and an availability that says how to launch one.

It is the worked example of docs/writing-a-plugin.md.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

from cardcage.sdk import (
    Accelerator,
    Availability,
    ClusterEnvironment,
    DistributedAccelerator,
    MisconfigurationError,
    Rule,
    SelectionContext,
    distributed_availability,
    env_int,
    hookimpl,
)

# --8<-- [start:environment]
JSRUN_VARIABLES = ("LSB_JOBID", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_RANK")


class LSFEnvironment(ClusterEnvironment):
    """Processes started by ``jsrun`` inside an LSF job."""

    name = "lsf"
    # Detection runs in ascending order: after torchelastic (200), so that torchrun inside
    # an LSF job stays torchrun's, and before SLURM (300).
    order = 250
    creates_processes = True
    # What `cardcage env` shows for this environment.
    variables = (
        *JSRUN_VARIABLES,
        "JSM_NAMESPACE_LOCAL_RANK",
        "LSB_DJOB_RANKFILE",
        "MASTER_ADDR",
        "MASTER_PORT",
    )

    @classmethod
    def detect(cls, env: Mapping[str, str], expected_world_size: int) -> bool:
        return all(name in env for name in JSRUN_VARIABLES)

    def world_size(self) -> int:
        return self._int("JSM_NAMESPACE_SIZE")

    def global_rank(self) -> int:
        return self._int("JSM_NAMESPACE_RANK")

    def local_rank(self) -> int:
        return self._int("JSM_NAMESPACE_LOCAL_RANK", 0)

    def node_rank(self) -> int:
        """This host's place among the job's compute hosts."""
        hosts = self.hosts()
        here = socket.gethostname().split(".")[0]
        if here not in hosts:
            raise MisconfigurationError(
                f"this host, {here!r}, is not among the compute hosts {hosts} of "
                f"LSB_DJOB_RANKFILE={self.env['LSB_DJOB_RANKFILE']!r}. Run the script with "
                "jsrun inside the LSF job, on the hosts LSF gave it."
            )
        return hosts.index(here)

    def master_address(self) -> str | None:
        # A MASTER_ADDR already set wins; otherwise rank 0 runs on the first compute host.
        return self.env.get("MASTER_ADDR") or self.hosts()[0]

    def master_port(self) -> int | None:
        # A MASTER_PORT already set wins; otherwise every rank derives the same port from
        # the job id, without talking to the others.
        port = super().master_port()
        return port if port is not None else 10000 + self._int("LSB_JOBID") % 1000

    def job_id(self) -> str | None:
        return self.env.get("LSB_JOBID")

    def hosts(self) -> list[str]:
        """The job's compute hosts in rank-file order; the file's first line is the launch
        node, which runs no rank."""
        path = self.env.get("LSB_DJOB_RANKFILE")
        if not path:
            raise MisconfigurationError(
                "jsrun started this process (JSM_NAMESPACE_RANK is set), but "
                "LSB_DJOB_RANKFILE is not set, so the job's hosts are unknown. Run the "
                "script with jsrun inside an LSF job (bsub)."
            )
        try:
            with open(path, encoding="utf-8") as lines:
                names = [line.strip().split(".")[0] for line in lines if line.strip()]
        except OSError as error:
            raise MisconfigurationError(
                f"LSB_DJOB_RANKFILE={path!r} cannot be read ({error.strerror}). Run the "
                "script with jsrun inside the LSF job that wrote it."
            ) from None
        return list(dict.fromkeys(names[1:])) or names[:1]

    def _int(self, name: str, default: int | None = None) -> int:
        value = env_int(self.env, name, default)
        if value is None:
            raise MisconfigurationError(f"environment variable {name} is not set. Run with jsrun.")
        return value


# --8<-- [end:environment]


# --8<-- [start:backend]
class LSFAccelerator(DistributedAccelerator):
    """The ``ddp`` machinery (process group, DistributedDataParallel, sharded data) in the
    processes jsrun started: nothing is relaunched or spawned."""

    name = "lsf"
    aliases = ("jsrun",)
    rules = (
        Rule(
            # Before ddp's rule (300), which would claim the job too, but only where
            # cardcage-ddp is installed.
            order=250,
            when=lambda ctx: isinstance(ctx.cluster, LSFEnvironment),
            why="jsrun started the processes of an LSF job",
            name="jsrun",
        ),
    )

    @classmethod
    def availability(cls, ctx: SelectionContext) -> Availability:
        if not isinstance(ctx.cluster, LSFEnvironment):
            return Availability(
                False,
                "this process was not started by jsrun (no JSM_NAMESPACE_RANK and LSB_JOBID)",
                "launch the script with jsrun inside an LSF job",
            )
        return distributed_availability()

    @classmethod
    def processes_per_node(cls, ctx: SelectionContext) -> int:
        if isinstance(ctx.cluster, LSFEnvironment):  # jsrun decided: its ranks per host
            return max(1, ctx.cluster.world_size() // len(ctx.cluster.hosts()))
        return super().processes_per_node(ctx)


# --8<-- [end:backend]


# --8<-- [start:hooks]
@hookimpl
def cardcage_accelerators() -> list[type[Accelerator]]:
    return [LSFAccelerator]


@hookimpl
def cardcage_cluster_environments() -> list[type[ClusterEnvironment]]:
    return [LSFEnvironment]


# --8<-- [end:hooks]
