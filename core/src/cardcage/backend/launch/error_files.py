"""Error files, and how a rank that left is told from one that finished.

A launcher sets ``CARDCAGE_ERROR_FILE`` for each process it starts; a rank that fails writes
the time and its traceback there, and the launcher names the first failing rank with it.

A rank that leaves without a word (``os._exit``, ``sys.exit(0)`` in a callback) is named too:

- under a cardcage launcher, each rank records the number of fits it finished next to its
  error file (:func:`record_fit_finished`, one small write a fit); a child that exits,
  whatever its status, before it finished the fit its launcher runs has left the job early
  (:func:`fits_finished`, read by :class:`~cardcage.backend.launch.supervisor.Supervisor`);
- where no cardcage launcher watches (torchrun, srun), each rank publishes its host and pid
  in the job's store when it joins the process group (:func:`join`), and the fits it
  finished; a rank whose collective fails looks there for a peer on its host whose process
  ended before it finished this fit (:func:`departure`), and names it instead of raising
  the bare "Connection closed by peer".
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import traceback
from pathlib import Path
from typing import Any

from cardcage.config import owners
from cardcage.errors import STOPPED_BY_CARDCAGE, RankFailedError

ERROR_FILE = "CARDCAGE_ERROR_FILE"
#: How long a failing rank waits for a peer's process to end (it may still be exiting).
DEPARTURE_GRACE_S = 1.0

#: Fits this process finished; where it published itself (``store, rank, world size``).
_state: dict[str, Any] = {"fits": 0, "roll": None}


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


# -- finished or left -----------------------------------------------------------------------


def fits_file(error_file: Path) -> Path:
    """Where the rank whose error file is ``error_file`` counts the fits it finished."""
    return error_file.with_suffix(".fits")


def record_fit_finished() -> None:
    """This process finished a fit: say so to its launcher (a file next to its error file)
    and to its peers (the job's store). Never raises: the fit succeeded."""
    _state["fits"] += 1
    fits = str(_state["fits"])
    path = os.environ.get(ERROR_FILE)
    if path:
        with contextlib.suppress(OSError):
            fits_file(Path(path)).write_text(fits)
    roll = _state["roll"]
    if roll is not None:
        with contextlib.suppress(Exception):
            roll[0].set(_finished_key(roll[1]), fits)


def fits_finished(error_file: Path) -> int:
    """How many fits the rank whose error file is ``error_file`` finished (0: none)."""
    try:
        return int(fits_file(error_file).read_text())
    except (OSError, ValueError):
        return 0


def left_early(code: int) -> str:
    """The reason of a rank that exited with ``code`` before its fit finished."""
    return f"left the job early (exited with status {code} before its fit finished)"


def _presence_key(rank: int) -> str:
    return f"cardcage/present/{rank}"


def _finished_key(rank: int) -> str:
    return f"cardcage/finished/{rank}"


def join(store: Any, rank: int, world_size: int) -> None:
    """Publish this rank in the job's ``store`` (its host, pid and start) once it joined
    the process group, so that a peer whose collective fails can tell whether it left."""
    _state["roll"] = None
    if world_size < 2:
        return
    with contextlib.suppress(Exception):
        if store is None:  # joined by env://: the store torch made for the group
            from torch.distributed import distributed_c10d

            store = distributed_c10d._get_default_store()  # no public API for this
        store.set(_presence_key(rank), owners.owner())
        _state["roll"] = (store, rank, world_size)


def departure(
    grace: float = DEPARTURE_GRACE_S, stopped: str = STOPPED_BY_CARDCAGE
) -> RankFailedError | None:
    """Called by a rank whose fit failed where no cardcage launcher watches it: the error
    naming the first peer on this host that left the job (its process ended) before it
    finished this fit, or ``None`` when none did (the failure is this rank's own, or a peer
    on another host's, which this rank cannot see). Waits up to ``grace`` seconds for a
    peer that is still exiting; ``stopped`` says who stops the other ranks. Never raises."""
    roll = _state["roll"]
    if roll is None:
        return None
    store, own, world_size = roll
    fit = _state["fits"] + 1  # the fit this rank is in
    host = owners.this_host()
    peers: dict[int, tuple[int, str]] = {}
    try:
        for rank in range(world_size):
            if rank == own or not store.check([_presence_key(rank)]):
                continue
            found = re.fullmatch(owners.OWNER, store.get(_presence_key(rank)).decode())
            if found is not None and found["host"] == host:
                peers[rank] = (int(found["pid"]), found["start"])
        deadline = time.monotonic() + grace
        while peers:
            for rank, (pid, started) in sorted(peers.items()):
                if not owners.ended(pid, started, host):
                    continue
                del peers[rank]
                key = _finished_key(rank)
                if store.check([key]) and int(store.get(key)) >= fit:
                    continue  # it finished this fit, then left: not the cause
                return RankFailedError(
                    rank,
                    None,
                    reason=f"left the job early (its process, pid {pid} on {host}, ended "
                    f"before its fit finished, and rank {own} failed because it was gone; "
                    f"rank {rank}'s own output says why, if it said anything)",
                    stopped=stopped,
                )
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
    except Exception:  # the store went with the job (a rank hosted it): nothing to add
        return None
    return None
