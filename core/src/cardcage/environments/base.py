"""The base of every cluster environment, and the environment-variable readers they share.

A cluster environment says who creates the processes, and each process's ranks and
rendezvous. The built-in ones (local, torchelastic, horovod: :mod:`cardcage.environments.builtin`;
SLURM: :mod:`cardcage.environments.slurm`) and the ones plugins register through the
``cardcage_cluster_environments`` hook all subclass :class:`ClusterEnvironment`; detection is
:func:`cardcage.environments.builtin.detect_cluster`'s. A ``MASTER_ADDR`` or ``MASTER_PORT``
already in the environment always wins over a derived one.

An environment that can requeue its job (SLURM) names the signal that asks for a requeue
(``requeue_signal_default``, overridden by ``CARDCAGE_REQUEUE_SIGNAL``, read by
:mod:`cardcage.config.variables`) and implements ``requeue``; :mod:`cardcage.train.requeue`
does the rest.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import ClassVar

from cardcage.config.variables import (
    REQUEUE_SIGNAL,
    parse_signal,
)
from cardcage.errors import MisconfigurationError

DEFAULT_MASTER_ADDR = "127.0.0.1"


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


def require_int(env: Mapping[str, str], name: str, default: int) -> int:
    """:func:`env_int` for a variable that always has a value (``default`` when unset)."""
    value = env_int(env, name, default)
    assert value is not None
    return value


def rank_in_range(name: str, value: int, size: int, against: str, fix: str) -> int:
    """``value``, the rank variable ``name``, checked to be in ``0..size-1``.

    ``against`` names what the size comes from (``"WORLD_SIZE=2"``), ``fix`` says what to do;
    out of range, the processes would wait for a rank that never comes (or never exists).
    """
    if value < 0:
        raise MisconfigurationError(
            f"environment variable {name}={value} is negative: ranks count from 0 "
            f"(0..{size - 1} for {against}). {fix}"
        )
    if value >= size:
        raise MisconfigurationError(
            f"environment variable {name}={value} is outside 0..{size - 1} for {against}. {fix}"
        )
    return value


def env_master_port(env: Mapping[str, str]) -> int | None:
    """``MASTER_PORT`` from ``env`` (checked to be a TCP port), or ``None`` when unset."""
    port = env_int(env, "MASTER_PORT")
    if port is not None and not 0 < port < 65536:
        raise MisconfigurationError(
            f"environment variable MASTER_PORT={port} is not a TCP port. Use 1..65535, or "
            "unset it to let cardcage choose a free port."
        )
    return port


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
        return env_master_port(self.env)

    def local_world_size(self) -> int | None:
        """Processes on this node, when the launcher that started them says; else ``None``."""
        return None

    # -- checkpoint and requeue (see cardcage.train.requeue) ------------------------------------

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
