"""Rank variables a process inherited from the training process that started it.

A training process (every rank, whoever started it) holds its job's rank variables
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, torchelastic's, ...) in its
environment, and a subprocess it starts (from a callback, a data-loading helper, a test
run from a fit) inherits them. Read as they are, they would make a ``cardcage.Trainer()``
in that subprocess a rank of the live job: "ddp, world 2", dialling the job's store.

So every training process exports :data:`RANK_PID` (``CARDCAGE_RANK_PID``) set to its own
pid (:func:`mark`). A process whose ``CARDCAGE_RANK_PID`` names another pid inherited the
variables from a rank: selection reads its environment without them (:func:`effective`),
as a plain local process. Launchers give each process they start its own value (or none):
a rank is never taken for a child of one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

from cardcage.errors import MisconfigurationError

#: The pid of the training process whose rank variables this environment holds.
RANK_PID = "CARDCAGE_RANK_PID"

#: The variables that make a process a rank of a job: torch.distributed's and torchelastic's,
#: horovodrun's and MPI's, a SLURM task's, and those cardcage's launchers set for a rank.
RANK_VARIABLES: tuple[str, ...] = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "HOROVOD_RANK",
    "HOROVOD_SIZE",
    "HOROVOD_LOCAL_RANK",
    "HOROVOD_LOCAL_SIZE",
    "HOROVOD_CROSS_RANK",
    "HOROVOD_CROSS_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NTASKS",
    "CARDCAGE_HOSTED_STORE",
    "CARDCAGE_HEARTBEAT",
    "CARDCAGE_ERROR_FILE",
    RANK_PID,
)
#: Prefixes of rank variables: every torchelastic variable, Open MPI's world.
RANK_PREFIXES: tuple[str, ...] = ("TORCHELASTIC_", "OMPI_COMM_WORLD_")


def rank_pid(env: Mapping[str, str]) -> int | None:
    """The pid ``CARDCAGE_RANK_PID`` names, or ``None`` when it is unset or empty."""
    raw = env.get(RANK_PID, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise MisconfigurationError(
            f"environment variable {RANK_PID}={raw!r} is not a process id. cardcage sets it "
            "in each training process to that process's pid; unset it."
        ) from None


def is_inherited(env: Mapping[str, str], pid: int | None = None) -> bool:
    """Whether ``env``'s rank variables belong to another process (a rank that started
    this one): ``CARDCAGE_RANK_PID`` names a pid other than ``pid`` (default: this
    process's)."""
    owner = rank_pid(env)
    return owner is not None and owner != (os.getpid() if pid is None else pid)


def is_rank_variable(name: str) -> bool:
    return name in RANK_VARIABLES or name.startswith(RANK_PREFIXES)


def effective(env: Mapping[str, str], pid: int | None = None) -> Mapping[str, str]:
    """``env`` as selection reads it: itself, or, when its rank variables were inherited
    (:func:`is_inherited`), a copy without them."""
    if not is_inherited(env, pid):
        return env
    return {name: value for name, value in env.items() if not is_rank_variable(name)}


def mark(environ: MutableMapping[str, str] | None = None, pid: int | None = None) -> None:
    """Say that ``environ``'s (default ``os.environ``) rank variables are this process's
    (or ``pid``'s): called in every training process before it trains."""
    target = os.environ if environ is None else environ
    target[RANK_PID] = str(os.getpid() if pid is None else pid)


def for_child(env: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """``env``, for a rank a launcher starts: without an inherited ``CARDCAGE_RANK_PID``
    (the rank marks itself), so that its own rank variables are read."""
    env.pop(RANK_PID, None)
    return env
