"""Which process owns a name, and whether that process has ended.

A name says whose it is by :func:`owner` (``<pid>.<start>@<host>``, matched by
:data:`OWNER`); :func:`ended` tells whether that process has ended. Launchers' folders
(:mod:`cardcage.backend.launch.tempdirs`), partial checkpoint files
(:mod:`cardcage.checkpoints.io`) and the ranks a job publishes
(:mod:`cardcage.backend.launch.error_files`) name their process this way. ``<start>`` is when
that process started, from ``/proc``, so that a reused pid is not taken for the owner; ``0``
where there is no ``/proc``.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from pathlib import Path

_UNSAFE = re.compile(r"[^A-Za-z0-9.-]")
#: How :func:`owner` names a process: ``<pid>.<start>@<host>``, its parts in groups.
OWNER = r"(?P<pid>\d+)\.(?P<start>\d+)@(?P<host>[A-Za-z0-9._-]+)"


def this_host() -> str:
    """This host's name as it goes into a name (letters, digits, ``.``, ``-``, ``_``)."""
    return _UNSAFE.sub("_", socket.gethostname())[:64] or "host"


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command's name (``[0]``: the state,
    ``[19]``: the start); ``None`` when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def start_of(pid: int) -> str:
    """When process ``pid`` started (clock ticks after boot, field 22 of
    ``/proc/<pid>/stat``); ``"0"`` where that cannot be read (no ``/proc``, or no such
    process): a pid that the kernel gave to a later process reads differently."""
    with contextlib.suppress(OSError, IndexError):
        fields = _stat(pid)
        if fields is not None:
            return fields[19]
    return "0"


#: The kernel's PF_EXITING bit in the flags of ``/proc/<pid>/stat``: set when a process
#: begins to exit, before it closes its files (and so its sockets).
_PF_EXITING = 0x4


def exiting(pid: int) -> bool:
    """Whether process ``pid`` has begun to exit, or has ended: its sockets may already be
    closed, so a peer may fail because of it before its exit status can be read. ``False``
    where that cannot be told (no ``/proc``)."""
    try:
        fields = _stat(pid)
    except OSError:
        return False
    if fields is None:
        return True
    with contextlib.suppress(IndexError, ValueError):
        return fields[0] in ("Z", "X") or bool(int(fields[6]) & _PF_EXITING)
    return False


def owner(pid: int | None = None) -> str:
    """Process ``pid`` (default: this one) as a name records it: ``<pid>.<start>@<host>``
    (:data:`OWNER`)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}.{start_of(pid)}@{this_host()}"


def ended(pid: int, start: str, host: str) -> bool:
    """Whether the process that :func:`owner` named ``<pid>.<start>@<host>`` has ended: it
    is gone, a zombie, or its pid belongs to a process that started at another time.

    ``False`` for another host's process (this one cannot see it), and whenever it cannot
    be told: a process that cannot be read is taken as alive, and a start of ``"0"`` (not
    known) matches any. Without ``/proc``, the pid alone says."""
    if host != this_host():
        return False
    if not Path("/proc/self/stat").exists():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False
    try:
        fields = _stat(pid)
    except OSError:
        return False  # it exists, but cannot be read
    if fields is None:
        return True
    if fields[0] in ("Z", "X"):
        return True
    now = fields[19] if len(fields) > 19 else "0"
    return "0" not in (now, start) and now != start
