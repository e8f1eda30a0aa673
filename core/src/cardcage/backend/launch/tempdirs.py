"""Launchers' temporary folders: private, and never left behind for good.

A launcher's folder holds what its processes share: ``ddp_spawn``'s
(``cardcage-workers-``) the pickled job (the model and the data) and the results; script
relaunch's (``cardcage-errors-``) the ranks' error files and progress counts; and, when
``max_restarts`` keeps step checkpoints without ``default_root_dir``, ``fit``'s
``cardcage-checkpoints-`` folder holds ``last.ckpt`` (the weights). :func:`make` creates it
private (mode 0700, as ``tempfile.mkdtemp`` does) and names it after the host and the
process that made it::

    cardcage-workers-<pid>.<start>@<host>-<random>

(``<start>``: when that process started, from ``/proc``, so that a reused pid is not taken
for the launcher; ``0`` where there is no ``/proc``). A launcher removes its folder when its
fit ends, also after a failure or SIGINT/SIGTERM/SIGHUP; one killed outright (SIGKILL, the
OOM killer) cannot. So before making its own, a launcher removes every such folder, of any
kind, whose launcher is gone (:func:`remove_stale`): never one whose launcher is alive, nor
one that another host made (a temporary folder shared between machines), nor one it cannot
read the owner of from the name.

Where the path must stay short (Ray's Unix sockets go under its session folder, and a
socket's path is limited to 107 characters), :func:`make_short` names the folder
``<prefix><random>`` and records the owner in a file inside it (:data:`OWNER_FILE`), which
:func:`remove_stale` reads the same way.

Whose a folder is, and whether that process has ended: :mod:`cardcage.config.owners`.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from cardcage.config.owners import OWNER, ended, owner

__all__ = ["FAMILY", "OWNER_FILE", "launcher_of", "make", "make_short", "remove_stale"]

#: The start of every kind of folder: ``cardcage-<kind>-`` (workers, errors, checkpoints).
FAMILY = "cardcage-"
#: A folder's name after its prefix: the rest of its kind (``<kind>-`` after
#: :data:`FAMILY`), the owner, then ``-`` and mkdtemp's random part.
_FOLDER = re.compile(r"(?:[a-z]+-)*" + OWNER + r"-[A-Za-z0-9_]+")
#: The file inside a :func:`make_short` folder that names its owner (``<pid>.<start>@<host>``).
OWNER_FILE = ".cardcage-owner"


def make(prefix: str, root: str | os.PathLike[str] | None = None) -> Path:
    """A new private folder ``<prefix><pid>.<start>@<host>-<random>`` under ``root`` (the
    temporary folder by default), after removing those of dead launchers there: of every
    kind when ``prefix`` is one of the :data:`FAMILY` (a killed ``ddp`` launcher's folders
    go at the next launch, whichever backend it uses)."""
    remove_stale(FAMILY if prefix.startswith(FAMILY) else prefix, root)
    folder = Path(tempfile.mkdtemp(prefix=f"{prefix}{owner()}-", dir=root))
    os.chmod(folder, 0o700)  # mkdtemp's mode, said here: the folder holds the user's job
    return folder


def make_short(prefix: str, root: str | os.PathLike[str] | None = None) -> Path:
    """A new private folder ``<prefix><random>`` under ``root`` (the temporary folder by
    default), its owner in :data:`OWNER_FILE` inside it, after removing those of dead
    launchers there (as :func:`make` does): for a path that must stay short."""
    remove_stale(FAMILY if prefix.startswith(FAMILY) else prefix, root)
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    os.chmod(folder, 0o700)
    (folder / OWNER_FILE).write_text(owner())
    return folder


def _recorded_owner(path: Path) -> tuple[int, str, str] | None:
    """``(pid, start, host)`` that a :func:`make_short` folder records; ``None`` without it."""
    try:
        found = re.fullmatch(OWNER, (path / OWNER_FILE).read_text().strip())
    except OSError:
        return None
    return None if found is None else (int(found["pid"]), found["start"], found["host"])


def launcher_of(name: str, prefix: str) -> tuple[int, str, str] | None:
    """``(pid, start, host)`` of the launcher that made folder ``name`` (``prefix`` and what
    follows of its kind: ``cardcage-workers-`` or :data:`FAMILY`); ``None`` when the name is
    not one :func:`make` gives."""
    found = _FOLDER.fullmatch(name[len(prefix) :]) if name.startswith(prefix) else None
    if found is None:
        return None
    return int(found["pid"]), found["start"], found["host"]


def remove_stale(prefix: str, root: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove this host's ``<prefix>*`` folders whose launcher has ended; return them."""
    folder = Path(root if root is not None else tempfile.gettempdir())
    removed = []
    try:
        candidates = [entry for entry in folder.iterdir() if entry.name.startswith(prefix)]
    except OSError:
        return []
    for path in candidates:
        launcher = launcher_of(path.name, prefix)
        if launcher is None and not path.is_symlink() and path.is_dir():
            launcher = _recorded_owner(path)
        if launcher is None or not ended(*launcher):
            continue  # not one of ours, another host's, or its launcher is (or may be) alive
        if not path.is_symlink() and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
