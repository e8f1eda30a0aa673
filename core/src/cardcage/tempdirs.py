"""Launchers' temporary folders: private, and never left behind for good.

A launcher's folder holds what its processes share: ``ddp_spawn``'s holds the pickled job
(the model and the data) and the results. :func:`make` creates it private (mode 0700, as
``tempfile.mkdtemp`` does) and names it after the host and the process that made it::

    cardcage-workers-<pid>.<start>@<host>-<random>

(``<start>``: when that process started, from ``/proc``, so that a reused pid is not taken
for the launcher; ``0`` where there is no ``/proc``). A launcher removes its folder when its
fit ends, also after a failure or SIGINT/SIGTERM/SIGHUP; one killed outright (SIGKILL, the
OOM killer) cannot. So before making its own, a launcher removes every folder of its kind
whose launcher is gone (:func:`remove_stale`): never one whose launcher is alive, nor one
that another host made (a temporary folder shared between machines), nor one it cannot
read the owner of from the name.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

__all__ = ["launcher_of", "make", "remove_stale"]

_UNSAFE = re.compile(r"[^A-Za-z0-9.-]")


def _host() -> str:
    """This host's name as it goes into a folder's name."""
    return _UNSAFE.sub("_", socket.gethostname())[:64] or "host"


def _started(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks after boot, ``/proc/<pid>/stat``), or
    ``None`` when it does not exist; ``"0"`` where ``/proc`` is missing."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        if not Path("/proc/self/stat").exists():  # no /proc here: the pid alone says
            return "0" if _exists(pid) else None
        return None
    except OSError:
        return "0"  # it exists, but cannot be read: alive, whatever its start
    return stat.rpartition(")")[2].split()[19]  # field 22: starttime


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def make(prefix: str, root: str | os.PathLike[str] | None = None) -> Path:
    """A new private folder ``<prefix><pid>.<start>@<host>-<random>`` under ``root`` (the
    temporary folder by default), after removing the ones of dead launchers there."""
    remove_stale(prefix, root)
    pid = os.getpid()
    owner = f"{pid}.{_started(pid) or '0'}@{_host()}-"
    folder = Path(tempfile.mkdtemp(prefix=prefix + owner, dir=root))
    os.chmod(folder, 0o700)  # mkdtemp's mode, said here: the folder holds the user's job
    return folder


def launcher_of(name: str, prefix: str) -> tuple[int, str, str] | None:
    """``(pid, start, host)`` of the launcher that made folder ``name``; ``None`` when the
    name is not one :func:`make` gives."""
    if not name.startswith(prefix):
        return None
    owner, at, rest = name[len(prefix) :].partition("@")
    pid, dot, start = owner.partition(".")
    host, dash, _ = rest.rpartition("-")  # mkdtemp's random part has no "-"
    if not (at and dot and dash and pid.isdigit() and start.isdigit() and host):
        return None
    return int(pid), start, host


def remove_stale(prefix: str, root: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove this host's ``<prefix>*`` folders whose launcher is gone; return them."""
    folder = Path(root if root is not None else tempfile.gettempdir())
    host = _host()
    removed = []
    try:
        candidates = [entry for entry in folder.iterdir() if entry.name.startswith(prefix)]
    except OSError:
        return []
    for path in candidates:
        launcher = launcher_of(path.name, prefix)
        if launcher is None or launcher[2] != host:
            continue
        pid, start, _ = launcher
        now = _started(pid)
        if now is not None and (now == start or "0" in (now, start)):
            continue  # its launcher is alive (or may be: a pid we cannot tell apart)
        if not path.is_symlink() and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
