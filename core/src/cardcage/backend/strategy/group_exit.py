"""How a process that joined a gloo process group leaves without aborting.

Gloo runs each collective on a worker thread of its own, and that thread drops its reference
to a finished collective a moment after the rank was told the collective is done. When that
reference is the last one to a tensor Python has already let go (a gathered state dict on a
rank that does not keep it, say), freeing it takes the GIL. If the interpreter is finalizing
by then, CPython ends the thread with ``pthread_exit``, which unwinds into a ``noexcept``
destructor: "terminate called without an active exception", exit -6, after a run that
finished (seen about once in 20 torchrun launches of the fsdp kit's job on two cores).

Destroying the process group does not stop those threads while Python objects (an FSDP
module, a device mesh) still hold the group. So at exit, while Python is alive, this module
destroys the group and then waits, with the GIL released, until the threads the group
started have nothing left to run (:func:`settle`). Workers cardcage starts itself leave with
``os._exit`` instead (:func:`cardcage.backend.launch.workers.leave`); this covers the processes
that run the user's script to its end: relaunched ranks, torchrun's, srun's.
"""

from __future__ import annotations

import atexit
import os
import time
from pathlib import Path

__all__ = ["register", "settle", "threads"]

_TASKS = Path("/proc/self/task")
#: Threads started by the process groups this process joined.
_watched: set[int] = set()


def threads() -> set[int]:
    """This process's thread ids (empty where ``/proc`` is missing: nothing to wait for)."""
    try:
        return {int(name) for name in os.listdir(_TASKS)}
    except OSError:
        return set()


def _runnable(tid: int) -> bool:
    try:
        stat = (_TASKS / str(tid) / "stat").read_text()
    except OSError:
        return False  # gone
    return stat.rpartition(")")[2].split()[0] == "R"


def settle(tids: set[int], timeout: float = 2.0, interval: float = 0.002) -> bool:
    """Wait until none of ``tids`` is runnable in two looks in a row, ``timeout`` at most.

    Sleeping releases the GIL, so a thread that waits for it to free a tensor gets it."""
    deadline = time.monotonic() + timeout
    calm = 0
    while calm < 2:
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
        calm = 0 if any(_runnable(tid) for tid in tids) else calm + 1
    return True


def _leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if _watched:
        settle(_watched)


def register(started: set[int]) -> None:
    """Watch the threads a process group ``started``; at exit, destroy the group and let
    them settle (once, however often the process joins a group)."""
    _watched.update(started)
    atexit.unregister(_leave_process_group)
    atexit.register(_leave_process_group)
