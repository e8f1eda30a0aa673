"""Error files: how a failing rank's traceback reaches the launcher that reports it.

A launcher sets ``CARDCAGE_ERROR_FILE`` for each process it starts; a rank that fails writes
the time and its traceback there, and the launcher names the first failing rank with it.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from pathlib import Path

ERROR_FILE = "CARDCAGE_ERROR_FILE"


def write_error_file(error: BaseException, path: str | os.PathLike[str] | None = None) -> None:
    """Record this rank's traceback (and when it failed) for the launcher's report, in
    ``path`` (default: ``CARDCAGE_ERROR_FILE``; replicas that are threads name their own)."""
    path = path or os.environ.get(ERROR_FILE)
    if not path:
        return
    with contextlib.suppress(OSError):
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        Path(path).write_text(f"{time.time()}\n{text}")


def read_error_file(path: Path) -> tuple[float, str]:
    """``(time of failure, traceback)``; ``(inf, "")`` when the rank left none."""
    try:
        stamp, _, text = path.read_text().partition("\n")
        return float(stamp), text
    except (OSError, ValueError):
        return float("inf"), ""


def first_recorded(folder: Path) -> tuple[int, str] | None:
    """``(rank, traceback)`` of the earliest ``rank-<R>.txt`` error file in ``folder``."""
    found = []
    for path in folder.glob("rank-*.txt"):
        when, text = read_error_file(path)
        found.append((when, int(path.stem.split("-")[1]), text))
    if not found:
        return None
    _, rank, text = min(found)
    return rank, text
