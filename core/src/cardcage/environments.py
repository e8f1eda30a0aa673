"""Cluster environments: who creates the processes, and each process's ranks and rendezvous.

Detection is ordered (ascending ``order``): horovodrun/mpirun (100), torchelastic or any
env:// launcher (200, so ``torchrun`` inside a SLURM allocation is torchrun's), SLURM managing
tasks (300), then the local machine. Plugins add environments through the
``cardcage_cluster_environments`` hook. A ``MASTER_ADDR`` or ``MASTER_PORT`` already in the
environment always wins over a derived one.

An environment that can requeue its job (SLURM) names the signal that asks for a requeue
(``requeue_signal_default``, overridden by ``CARDCAGE_REQUEUE_SIGNAL``) and implements
``requeue``; :mod:`cardcage.requeue` does the rest.
"""

from __future__ import annotations

import re
import signal
import subprocess
from collections.abc import Mapping
from typing import ClassVar

from cardcage.errors import MisconfigurationError

INTERACTIVE_SLURM_JOB_NAMES = ("bash", "interactive")
DEFAULT_MASTER_ADDR = "127.0.0.1"
REQUEUE_SIGNAL = "CARDCAGE_REQUEUE_SIGNAL"
REQUEUE_OFF = ("", "0", "none", "off", "no", "false")


def env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    """An integer environment variable, or ``default`` when unset; garbage is an error."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise MisconfigurationError(
            f"environment variable {name}={raw!r} is not an integer. Unset it, or set it to "
            "the integer the launcher would give."
        ) from None


def _require_int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env_int(env, name, default)
    assert value is not None
    return value


def _master_port(env: Mapping[str, str]) -> int | None:
    port = env_int(env, "MASTER_PORT")
    if port is not None and not 0 < port < 65536:
        raise MisconfigurationError(
            f"environment variable MASTER_PORT={port} is not a TCP port. Use 1..65535, or "
            "unset it to let cardcage choose a free port."
        )
    return port


def parse_signal(value: str, source: str = REQUEUE_SIGNAL) -> signal.Signals | None:
    """A signal named like ``USR1``, ``SIGUSR1`` or ``10``; ``None`` for ``none``/``off``/``0``."""
    text = value.strip()
    if text.lower() in REQUEUE_OFF:
        return None
    try:
        if text.isdigit():
            return signal.Signals(int(text))
        name = text.upper()
        return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    except (KeyError, ValueError):
        pass
    raise MisconfigurationError(
        f"{source}={value!r} is not a signal. Use a name such as USR1 or USR2 (the one given "
        "to sbatch --signal), a number, or none to turn checkpoint-and-requeue off."
    )


class ClusterEnvironment:
    """Base class of a cluster environment. Subclass it and register the subclass.

    Class attributes:
        name: what ``Selection.cluster`` reports.
        order: detection order; lower is tried first.
        variables: environment variables ``cardcage env`` shows for this environment.
        requeue_signal_default: the signal that asks the job to checkpoint and requeue
            itself, or ``None`` when this environment cannot requeue (the default).

    An instance reads one environment mapping; ``expected_world_size`` is the number of
    processes the flags ask for (``num_nodes`` x processes per node).
    """

    name: ClassVar[str] = "local"
    order: ClassVar[int] = 10_000
    variables: ClassVar[tuple[str, ...]] = ()
    #: Whether something outside cardcage already started one process per rank.
    creates_processes: ClassVar[bool] = False
    #: Whether the launcher that started them gives torch.distributed a rendezvous
    #: (``MASTER_ADDR``/``MASTER_PORT``); mpirun and horovodrun do not.
    provides_rendezvous: ClassVar[bool] = True

    def __init__(self, env: Mapping[str, str], expected_world_size: int, num_nodes: int = 1):
        self.env = env
        self.expected_world_size = expected_world_size
        self.num_nodes = num_nodes

    @classmethod
    def detect(cls, env: Mapping[str, str], expected_world_size: int) -> bool:
        """Whether this environment applies to a process with environment ``env``."""
        return False

    @classmethod
    def note(cls, env: Mapping[str, str], expected_world_size: int) -> str | None:
        """A warning when the environment is present but not used (e.g. SLURM not managing)."""
        return None

    def world_size(self) -> int:
        return self.expected_world_size

    def global_rank(self) -> int:
        return 0

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return 0

    def master_address(self) -> str | None:
        return self.env.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR

    def master_port(self) -> int | None:
        """The rendezvous port, or ``None`` when a free one is to be chosen at launch."""
        return _master_port(self.env)

    def local_world_size(self) -> int | None:
        """Processes on this node, when the launcher that started them says; else ``None``."""
        return None

    # -- checkpoint and requeue (see cardcage.requeue) ------------------------------------

    requeue_signal_default: ClassVar[str | None] = None

    def requeue_signal(self) -> signal.Signals | None:
        """The signal that asks for checkpoint-and-requeue, or ``None`` when it is off.

        ``CARDCAGE_REQUEUE_SIGNAL`` (a name such as ``USR2``, a number, or ``none``)
        overrides ``requeue_signal_default``. Raises
        :class:`~cardcage.MisconfigurationError` for a value that is not a signal.
        """
        if self.requeue_signal_default is None:
            return None
        return parse_signal(self.env.get(REQUEUE_SIGNAL, self.requeue_signal_default))

    def job_id(self) -> str | None:
        """The scheduler's id of this job (it names the requeue checkpoint)."""
        return None

    def restart_count(self) -> int:
        """How many times the scheduler restarted (requeued) this job; 0 on its first run."""
        return 0

    def requeue_dir(self) -> str | None:
        """Where the requeue checkpoint goes when the Trainer has no ``default_root_dir``."""
        return None

    def requeue(self) -> None:
        """Ask the scheduler to requeue this job; raise ``RuntimeError`` when it refuses."""
        raise RuntimeError(f"the {self.name!r} cluster environment cannot requeue a job")


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
        return self.node_rank() * (self.expected_world_size // max(self.num_nodes, 1))


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
        size = _require_int(self.env, "WORLD_SIZE", 1)
        if size < 1:
            raise MisconfigurationError(
                f"environment variable WORLD_SIZE={size} must be at least 1. Fix the "
                "launcher's WORLD_SIZE (the number of processes of the job), or unset it."
            )
        return size

    def local_rank(self) -> int:
        return _require_int(self.env, "LOCAL_RANK", 0)

    def local_world_size(self) -> int | None:
        return env_int(self.env, "LOCAL_WORLD_SIZE")

    def node_rank(self) -> int:
        group = env_int(self.env, "GROUP_RANK")
        return group if group is not None else _require_int(self.env, "NODE_RANK", 0)

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
                f"environment variable RANK={rank} is outside 0..{self.world_size() - 1} for "
                f"WORLD_SIZE={self.world_size()}. Fix the launcher's RANK or WORLD_SIZE."
            )
        return rank


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"n[3-5,7],m1"`` → ``"n3"``, ``"a01"`` → ``"a01"``."""
    depth, end = 0, len(nodelist)
    for index, char in enumerate(nodelist):
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            end = index
            break
    first = nodelist[:end].strip()
    match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", first)
    if not match:
        return first
    prefix, ranges, suffix = match.groups()
    start = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{start}{suffix}"


class SLURMEnvironment(ClusterEnvironment):
    """A SLURM job step whose tasks are the training processes.

    SLURM manages tasks when ``SLURM_NTASKS`` equals the world size the flags ask for and the
    job is not an interactive shell (``SLURM_JOB_NAME`` ``bash`` or ``interactive``).
    Lightning 1.0 compared against ``num_processes`` alone on the CPU, so a multi-node CPU
    job was never managed; here the comparison is with ``num_nodes`` x processes per node.
    """

    name = "slurm"
    order = 300
    creates_processes = True
    variables = (
        "SLURM_JOB_ID",
        "SLURM_JOB_NAME",
        "SLURM_NTASKS",
        "SLURM_NTASKS_PER_NODE",
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "SLURM_NODEID",
        "SLURM_NODELIST",
        "SLURM_JOB_NODELIST",
        "SLURM_RESTART_COUNT",
        "SLURM_SUBMIT_DIR",
        "MASTER_ADDR",
        "MASTER_PORT",
        REQUEUE_SIGNAL,
    )
    # sbatch --signal=USR1@90 sends it to every task 90 s before the time limit.
    requeue_signal_default = "SIGUSR1"

    @classmethod
    def detect(cls, env: Mapping[str, str], expected_world_size: int) -> bool:
        if "SLURM_NTASKS" not in env:
            return False
        if env.get("SLURM_JOB_NAME", "") in INTERACTIVE_SLURM_JOB_NAMES:
            return False
        return env_int(env, "SLURM_NTASKS") == expected_world_size

    @classmethod
    def note(cls, env: Mapping[str, str], expected_world_size: int) -> str | None:
        if "SLURM_NTASKS" not in env or cls.detect(env, expected_world_size):
            return None
        if env.get("SLURM_JOB_NAME", "") in INTERACTIVE_SLURM_JOB_NAMES:
            return (
                f"interactive SLURM job (SLURM_JOB_NAME={env['SLURM_JOB_NAME']!r}): cardcage "
                "starts its own processes."
            )
        return (
            f"SLURM_NTASKS={env['SLURM_NTASKS']} differs from the {expected_world_size} "
            "processes the flags ask for (num_nodes x processes per node), so SLURM is not "
            "managing tasks and cardcage starts its own processes. To let SLURM start them, "
            "set --ntasks-per-node to the processes per node."
        )

    def world_size(self) -> int:
        return _require_int(self.env, "SLURM_NTASKS", 1)

    def global_rank(self) -> int:
        return _require_int(self.env, "SLURM_PROCID", 0)

    def local_rank(self) -> int:
        return _require_int(self.env, "SLURM_LOCALID", 0)

    def node_rank(self) -> int:
        return _require_int(self.env, "SLURM_NODEID", 0)

    def master_address(self) -> str | None:
        if self.env.get("MASTER_ADDR"):
            return self.env["MASTER_ADDR"]
        nodelist = self.env.get("SLURM_NODELIST") or self.env.get("SLURM_JOB_NODELIST")
        return first_slurm_host(nodelist) if nodelist else DEFAULT_MASTER_ADDR

    def master_port(self) -> int | None:
        port = _master_port(self.env)
        if port is not None:
            return port
        job_id = self.env.get("SLURM_JOB_ID", "")
        digits = "".join(c for c in job_id if c.isdigit())
        # The seed's scheme: every task of a job derives the same port without talking.
        return 15000 + int(digits[-4:]) if digits else 12910

    def job_id(self) -> str | None:
        return self.env.get("SLURM_JOB_ID") or self.env.get("SLURM_JOBID") or None

    def restart_count(self) -> int:
        return _require_int(self.env, "SLURM_RESTART_COUNT", 0)

    def requeue_dir(self) -> str | None:
        return self.env.get("SLURM_SUBMIT_DIR") or None

    def requeue(self) -> None:
        """``scontrol requeue $SLURM_JOB_ID`` (a batch job, submitted requeueable)."""
        job_id = self.job_id()
        if not job_id:
            raise RuntimeError("SLURM_JOB_ID is not set: no job to requeue")
        command = ["scontrol", "requeue", job_id]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise RuntimeError(f"`{' '.join(command)}` failed: {error}") from None
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip()
            raise RuntimeError(f"`{' '.join(command)}` exited {done.returncode}: {said}")


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

    def _first(self, *names: str, default: int = 0) -> int:
        for name in names:
            value = env_int(self.env, name)
            if value is not None:
                return value
        return default

    def world_size(self) -> int:
        return self._first("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", default=1)

    def global_rank(self) -> int:
        return self._first("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK")

    def local_rank(self) -> int:
        return self._first("HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")

    def local_world_size(self) -> int | None:
        size = self._first("HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")
        return size or None

    def node_rank(self) -> int:
        return self._first("HOROVOD_CROSS_RANK", "OMPI_COMM_WORLD_NODE_RANK")

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
