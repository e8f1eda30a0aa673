"""Cluster environments: which one this process runs in, and the built-in ones but SLURM.

Detection is ordered (ascending ``order``): horovodrun/mpirun (100), torchelastic or any
env:// launcher (200, so ``torchrun`` inside a SLURM allocation is torchrun's), SLURM managing
tasks (300, :mod:`cardcage.environments.slurm`), then the local machine. Plugins add
environments through the ``cardcage_cluster_environments`` hook. A ``MASTER_ADDR`` or
``MASTER_PORT`` already in the environment always wins over a derived one.

"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from cardcage.environments.base import (
    ClusterEnvironment,
    env_int,
    rank_in_range,
    require_int,
)
from cardcage.environments.slurm import (
    SLURMEnvironment,
)
from cardcage.errors import MisconfigurationError


class LocalEnvironment(ClusterEnvironment):
    """This machine; cardcage starts the processes itself (relaunch or spawn).

    ``NODE_RANK`` (or torchelastic's ``GROUP_RANK``) with ``WORLD_SIZE`` but no
    ``LOCAL_RANK`` is a manual multi-node launch: this node starts its own processes.
    Lightning 1.0 took it for torchelastic and hung (#5651).
    """

    name = "local"
    variables = ("NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")

    def node_rank(self) -> int:
        node = env_int(self.env, "NODE_RANK")
        group = env_int(self.env, "GROUP_RANK")
        if node is not None and group is not None and node != group:
            raise MisconfigurationError(
                f"environment variables NODE_RANK={node} and GROUP_RANK={group} disagree. "
                "Unset one of them."
            )
        rank = node if node is not None else (group or 0)
        if not 0 <= rank < self.num_nodes:
            raise MisconfigurationError(
                f"environment variable NODE_RANK={rank} is outside 0..{self.num_nodes - 1} "
                f"for num_nodes={self.num_nodes}. Set NODE_RANK to this node's index, or "
                "num_nodes to the number of nodes."
            )
        if rank > 0 and "MASTER_ADDR" not in self.env:
            raise MisconfigurationError(
                f"NODE_RANK={rank} starts a node of a multi-node job, but MASTER_ADDR is not "
                "set, so this node cannot find node 0. Set MASTER_ADDR (and MASTER_PORT) to "
                "node 0's address and port."
            )
        return rank

    def global_rank(self) -> int:
        self._check_stale_ranks()
        return self.node_rank() * (self.expected_world_size // max(self.num_nodes, 1))

    def _check_stale_ranks(self) -> None:
        """``RANK`` and ``WORLD_SIZE`` without ``LOCAL_RANK``: cardcage starts the processes
        and gives them their own, but a pair that contradicts itself is a launcher's mistake
        (or left over from one), said here rather than ignored."""
        rank, size = env_int(self.env, "RANK"), env_int(self.env, "WORLD_SIZE")
        if rank is None or size is None:
            return
        if size < 1:
            raise MisconfigurationError(
                f"environment variable WORLD_SIZE={size} must be at least 1. Fix the "
                "launcher's WORLD_SIZE, or unset it (cardcage starts the processes here)."
            )
        rank_in_range(
            "RANK",
            rank,
            size,
            f"WORLD_SIZE={size}",
            "Fix the launcher's RANK or WORLD_SIZE (with LOCAL_RANK unset, cardcage starts the "
            "processes and gives them their ranks), or unset both.",
        )


class TorchElasticEnvironment(ClusterEnvironment):
    """Processes created by torchrun/torchelastic, or any env:// launcher.

    Detected by ``TORCHELASTIC_RUN_ID``, or by ``WORLD_SIZE`` together with ``LOCAL_RANK``.
    """

    name = "torchelastic"
    order = 200
    creates_processes = True
    variables = (
        "TORCHELASTIC_RUN_ID",
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    )

    @classmethod
    def detect(cls, env: Mapping[str, str], expected_world_size: int) -> bool:
        return "TORCHELASTIC_RUN_ID" in env or ("WORLD_SIZE" in env and "LOCAL_RANK" in env)

    def world_size(self) -> int:
        size = require_int(self.env, "WORLD_SIZE", 1)
        if size < 1:
            raise MisconfigurationError(
                f"environment variable WORLD_SIZE={size} must be at least 1. Fix the "
                "launcher's WORLD_SIZE (the number of processes of the job), or unset it."
            )
        return size

    def local_rank(self) -> int:
        local = require_int(self.env, "LOCAL_RANK", 0)
        per_node = self.local_world_size()
        if per_node is not None:
            against, size = f"LOCAL_WORLD_SIZE={per_node}", per_node
        else:
            against, size = f"WORLD_SIZE={self.world_size()}", self.world_size()
        return rank_in_range(
            "LOCAL_RANK",
            local,
            size,
            against,
            "Fix the launcher's LOCAL_RANK (this process's index on its node) or "
            f"{against.partition('=')[0]}.",
        )

    def local_world_size(self) -> int | None:
        size = env_int(self.env, "LOCAL_WORLD_SIZE")
        if size is not None and not 0 < size <= self.world_size():
            raise MisconfigurationError(
                f"environment variable LOCAL_WORLD_SIZE={size} is outside 1.."
                f"{self.world_size()} for WORLD_SIZE={self.world_size()}: a node runs at least "
                "one of the job's processes and at most all of them. Fix the launcher's "
                "LOCAL_WORLD_SIZE (the processes on this node) or WORLD_SIZE."
            )
        return size

    def node_rank(self) -> int:
        group = env_int(self.env, "GROUP_RANK")
        name, rank = ("GROUP_RANK", group) if group is not None else ("NODE_RANK", None)
        if rank is None:
            rank = require_int(self.env, "NODE_RANK", 0)
        size = self.world_size()
        return rank_in_range(
            name,
            rank,
            size,
            f"WORLD_SIZE={size} (a node runs at least one process)",
            f"Fix the launcher's {name} (this node's index) or WORLD_SIZE.",
        )

    def global_rank(self) -> int:
        local = self.local_rank()  # a bad LOCAL_RANK is reported as itself, first
        rank = env_int(self.env, "RANK")
        if rank is None:
            per_node = env_int(self.env, "LOCAL_WORLD_SIZE")
            if per_node is None:
                found = (
                    "TORCHELASTIC_RUN_ID is set (a torchelastic launch)"
                    if "TORCHELASTIC_RUN_ID" in self.env
                    else "WORLD_SIZE and LOCAL_RANK are set (an env:// launch)"
                )
                raise MisconfigurationError(
                    f"{found}, but RANK is not. Set RANK (or LOCAL_WORLD_SIZE) for every "
                    "process, or launch with torchrun."
                )
            rank = self.node_rank() * per_node + local
            if not 0 <= rank < self.world_size():
                raise MisconfigurationError(
                    f"RANK is not set, and the rank made of the node rank {self.node_rank()}, "
                    f"LOCAL_WORLD_SIZE={per_node} and LOCAL_RANK={local} is {rank}, outside "
                    f"0..{self.world_size() - 1} for WORLD_SIZE={self.world_size()}. Set RANK "
                    "for every process, or fix the launcher's LOCAL_WORLD_SIZE or WORLD_SIZE."
                )
            return rank
        return rank_in_range(
            "RANK",
            rank,
            self.world_size(),
            f"WORLD_SIZE={self.world_size()}",
            "Fix the launcher's RANK or WORLD_SIZE.",
        )


class HorovodEnvironment(ClusterEnvironment):
    """Processes started by ``horovodrun`` (any controller) or Open MPI's ``mpirun``."""

    name = "horovod"
    order = 100
    creates_processes = True
    variables = (
        "HOROVOD_RANK",
        "HOROVOD_SIZE",
        "HOROVOD_LOCAL_RANK",
        "HOROVOD_CROSS_RANK",
        "HOROVOD_CONTROLLER",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_NODE_RANK",
    )

    @classmethod
    def detect(cls, env: Mapping[str, str], expected_world_size: int) -> bool:
        return "HOROVOD_RANK" in env or "OMPI_COMM_WORLD_RANK" in env

    def _named(self, *names: str, default: int = 0) -> tuple[str | None, int]:
        """The first of ``names`` that is set, and its value; ``(None, default)`` if none."""
        for name in names:
            value = env_int(self.env, name)
            if value is not None:
                return name, value
        return None, default

    def _first(self, *names: str, default: int = 0) -> int:
        return self._named(*names, default=default)[1]

    def _size(self, *names: str, default: int) -> tuple[str, int]:
        name, size = self._named(*names, default=default)
        if name is not None and size < 1:
            raise MisconfigurationError(
                f"environment variable {name}={size} must be at least 1. Start the job with "
                "horovodrun or mpirun, which set it, and do not set it by hand."
            )
        return f"{name}={size}" if name else f"a size of {size}", size

    def _rank(self, names: tuple[str, ...], size: tuple[str, int]) -> int:
        name, rank = self._named(*names)
        if name is None:
            return rank
        return rank_in_range(
            name,
            rank,
            size[1],
            size[0],
            "Start the job with horovodrun or mpirun, which set the ranks, and do not set them "
            "by hand (or unset ones left over from another job).",
        )

    def world_size(self) -> int:
        return self._size("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", default=1)[1]

    def global_rank(self) -> int:
        world = self._size("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", default=1)
        return self._rank(("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK"), world)

    def local_rank(self) -> int:
        names = ("HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")
        size = self._size(*names, default=0) if self._named(*names)[0] else None
        world = self._size("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", default=1)
        return self._rank(("HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"), size or world)

    def local_world_size(self) -> int | None:
        size = self._first("HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")
        return size or None

    def node_rank(self) -> int:
        world = self._size("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", default=1)
        return self._rank(("HOROVOD_CROSS_RANK", "OMPI_COMM_WORLD_NODE_RANK"), world)

    provides_rendezvous: ClassVar[bool] = False

    def master_address(self) -> str | None:
        return self.env.get("MASTER_ADDR")  # Horovod rendezvouses on its own


BUILTIN_ENVIRONMENTS: tuple[type[ClusterEnvironment], ...] = (
    HorovodEnvironment,
    TorchElasticEnvironment,
    SLURMEnvironment,
)


def detect_cluster(
    env: Mapping[str, str],
    expected_world_size: int,
    num_nodes: int,
    environments: tuple[type[ClusterEnvironment], ...] = BUILTIN_ENVIRONMENTS,
) -> tuple[ClusterEnvironment, list[str]]:
    """The first environment (by ``order``) that detects itself, else the local one.

    Returns the instance and the notes of environments present but not used.
    """
    notes: list[str] = []
    for cls in sorted(environments, key=lambda c: (c.order, c.name)):
        if cls.detect(env, expected_world_size):
            return cls(env, expected_world_size, num_nodes), notes
        note = cls.note(env, expected_world_size)
        if note:
            notes.append(note)
    return LocalEnvironment(env, expected_world_size, num_nodes), notes
