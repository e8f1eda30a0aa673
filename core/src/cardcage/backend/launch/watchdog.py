"""Stuck ranks: the rank that keeps the others waiting is named, with its stack.

A rank that spins (or sleeps, or waits on a lock) inside ``training_step`` leaves its peers
waiting inside a collective, and gloo or NCCL would end the job only after their own
timeout, blaming a rank that waited. Instead, every rank of a job whose launcher started all
of its processes on this node (script relaunch, spawned workers) counts its progress in a
shared file the launcher made (:data:`HEARTBEAT` names its folder):

- the loop beats before each training step, after the step function returned, after the
  optimizer step and for each validation batch (:class:`Heart`): one store into shared
  memory, tens of nanoseconds, no system call and no collective;
- each rank attaches as its fit begins, before its setup (the process group,
  ``configure_optimizers``), so that a rank stuck there shows its stack and pid too;
- the launcher's supervisor reads the counts about once a second (:class:`Watch`). When no
  rank has moved for ``CARDCAGE_STUCK_WARN`` seconds (default 60), the ranks whose count is
  lowest are the ones the others wait for: stderr names them and shows their Python stacks
  (each rank dumps its own on SIGUSR2 with :mod:`faulthandler`, into a file the launcher
  prints). After ``CARDCAGE_TIMEOUT`` seconds (default 1800) the job fails with a
  :class:`~cardcage.errors.RankFailedError` naming the first of them;
- a rank that is stopped (SIGSTOP, state ``T``) is the one the others wait for, whatever
  its count and whichever phase of the fit it was stopped in (its setup, after the loop):
  the watcher reads its state from ``/proc``;
- a Cage collective that only some ranks call (``if cage.global_rank == 0:
  cage.barrier()``) would leave them waiting until ``CARDCAGE_TIMEOUT`` and then blame one
  of them. Each rank marks which Cage collective it is in (:meth:`Heart.enter`, one more
  store, made by the Cage's collectives only, never by the Trainer's step): its sequence
  number and kind, negated once it returned. When, for :data:`JOIN_S` seconds, no rank's
  mark changed while some ranks are inside one collective and another rank is inside a
  different one, or has returned from the launched function, the job fails at once with a
  :class:`~cardcage.errors.RankFailedError` naming the collective by its Cage method, the
  ranks that called it and the rank that did not (with what it is doing, and its stack). A
  rank in no Cage collective is not judged: it may only be late.

The process group's own timeout is set a little beyond ``CARDCAGE_TIMEOUT``
(:func:`collective_timeout`), so that the watcher, which knows who is behind, speaks first.
Where no cardcage launcher watches (torchrun, srun, several nodes), that timeout ends the job.
"""

from __future__ import annotations

import contextlib
import faulthandler
import mmap
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import IO

from cardcage.config.variables import STUCK_WARN, TIMEOUT, job_timeout, stuck_warn

#: The folder of a job's heartbeat file and stack dumps (set by the launcher for every rank).
HEARTBEAT = "CARDCAGE_HEARTBEAT"
#: The signal on which a watched rank writes its Python stacks to its stack file.
STACK_SIGNAL = signal.SIGUSR2
#: The count of a rank that left the training loop: it is no longer one to wait for.
FINISHED = 1 << 62
#: How much later than ``CARDCAGE_TIMEOUT`` the process group gives up by itself.
MARGIN_S = 30.0
#: How long the ranks must have sat in different Cage collectives before the job fails.
JOIN_S = 3.0
_SLOT = 3  # int64s per rank: its count, its pid, the Cage collective it is in (or was last)

#: The kinds of Cage call a rank marks (the call slot holds ``sequence * 16 + kind`` while
#: the rank is inside it, and minus that once it returned; 0 before its first).
BARRIER, ALL_REDUCE, ALL_GATHER, BROADCAST, SAVE, BACKWARD, RETURNED = range(1, 8)
#: What the messages call each kind: the Cage's method.
CALLS = {
    BARRIER: "cage.barrier()",
    ALL_REDUCE: "cage.all_reduce()",
    ALL_GATHER: "cage.all_gather()",
    BROADCAST: "cage.broadcast()",
    SAVE: "cage.save()",
    BACKWARD: "cage.backward()",
    RETURNED: "the hand-back of the launched function's value",
}


def collective_timeout() -> timedelta:
    """How long a collective may wait: ``CARDCAGE_TIMEOUT`` and a margin."""
    return timedelta(seconds=job_timeout() + MARGIN_S)


def _view(path: Path) -> tuple[mmap.mmap, memoryview]:
    with open(path, "r+b") as stream:
        mapped = mmap.mmap(stream.fileno(), 0)
    return mapped, memoryview(mapped).cast("q")


class Heart:
    """A rank's side: its count in the shared file, its stack on :data:`STACK_SIGNAL`."""

    __slots__ = ("call", "calls", "count", "index", "mapped", "stacks", "view")

    def __init__(self, folder: Path, rank: int):
        self.mapped, self.view = _view(folder / "beats")
        self.index = rank * _SLOT
        self.count = 0
        self.calls = 0  # the Cage collectives this rank entered in this fit
        self.call = 0
        self.view[self.index] = 0  # in this fit, not yet stepped (an earlier fit finished)
        self.view[self.index + 1] = os.getpid()
        self.view[self.index + 2] = 0
        self.stacks: IO[str] = open(folder / f"stack-{rank}.txt", "a")  # noqa: SIM115
        faulthandler.register(STACK_SIGNAL, file=self.stacks, all_threads=True)

    def beat(self) -> None:
        self.count += 1
        self.view[self.index] = self.count

    def enter(self, kind: int) -> None:
        """This rank is inside a Cage collective of ``kind`` (its next one)."""
        self.calls += 1
        self.call = self.calls * 16 + kind
        self.view[self.index + 2] = self.call

    def leave(self) -> None:
        """This rank returned from the Cage collective it entered last."""
        self.view[self.index + 2] = -self.call

    def finish(self) -> None:
        """This rank left the loop: nobody waits for it any more."""
        self.view[self.index] = FINISHED

    def close(self) -> None:
        """This rank's fit ended: no more counts, no more stacks."""
        self.finish()
        self.view[self.index + 2] = 0
        faulthandler.unregister(STACK_SIGNAL)
        self.stacks.close()
        self.view.release()
        with contextlib.suppress(BufferError):
            self.mapped.close()


def attach() -> Heart | None:
    """This rank's :class:`Heart` when its launcher watches it (``None`` otherwise)."""
    folder = os.environ.get(HEARTBEAT)
    if not folder or not Path(folder, "beats").exists():
        return None
    return Heart(Path(folder), int(os.environ.get("RANK", "0")))


class Watch:
    """The launcher's side: reads every rank's count; names the ranks the others wait for."""

    def __init__(self, folder: Path, world_size: int, pids: dict[int, int] | None = None):
        self.folder = folder
        self.world_size = world_size
        #: The pids the launcher knows (its children's): a rank that has not attached yet
        #: is still found by them.
        self.pids = dict(pids or {})
        (folder / "beats").write_bytes(bytes(8 * _SLOT * world_size))
        self.mapped, self.view = _view(folder / "beats")
        self.warn_after = stuck_warn()
        self.fail_after = job_timeout()
        self.restart()

    def restart(self) -> None:
        """Start watching afresh (a fit begins): armed once a rank steps in this fit, or
        at once for a rank that is stopped."""
        for rank in range(self.world_size):
            self.view[rank * _SLOT] = 0
            self.view[rank * _SLOT + 2] = 0
        self.last = self.counts()
        self.moved_at = time.monotonic()
        self.warned = False
        self.last_calls = self.calls()
        self.calls_at = self.moved_at
        #: When each rank's call slot was first seen holding its present value.
        self.entered = [self.moved_at] * self.world_size

    def calls(self) -> list[int]:
        return [int(self.view[r * _SLOT + 2]) for r in range(self.world_size)]

    def counts(self) -> list[int]:
        return [int(self.view[r * _SLOT]) for r in range(self.world_size)]

    def pid(self, rank: int) -> int:
        """``rank``'s pid: the one it wrote when it attached, else the one its launcher
        knows (0 when neither: the launching process's own rank before it attached)."""
        return int(self.view[rank * _SLOT + 1]) or self.pids.get(rank, 0)

    def stopped(self) -> list[int]:
        """The ranks whose process is stopped (SIGSTOP, SIGTSTP: state ``T`` in ``/proc``)."""
        found = []
        for rank in range(self.world_size):
            pid = self.pid(rank)
            if pid <= 0 or pid == os.getpid():
                continue  # unknown, or this process: running, since it reads this
            with contextlib.suppress(OSError, IndexError):
                stat = Path(f"/proc/{pid}/stat").read_text()
                if stat.rpartition(")")[2].split()[0] == "T":
                    found.append(rank)
        return found

    def check(self, now: float) -> tuple[int, str, str] | None:
        """``(rank, reason, stack)`` once the job has waited ``CARDCAGE_TIMEOUT`` for that
        rank; warns on stderr after ``CARDCAGE_STUCK_WARN``. ``None`` while all is well.
        Ranks in different Cage collectives for :data:`JOIN_S` fail the job at once
        (:meth:`split`)."""
        calls = self.calls()
        if calls != self.last_calls:
            for rank, (was, call) in enumerate(zip(self.last_calls, calls, strict=True)):
                if was != call:
                    self.entered[rank] = now
            self.last_calls, self.calls_at = calls, now
        elif now - self.calls_at >= JOIN_S:
            split = self.split(calls, now)
            if split is not None:
                return split
        counts = self.counts()
        if counts != self.last:
            self.last, self.moved_at, self.warned = counts, now, False
            return None
        still = now - self.moved_at
        if still < self.warn_after:
            return None
        stopped = self.stopped()
        active = [r for r, c in enumerate(counts) if c != FINISHED]
        if stopped:
            behind = stopped  # whatever its count, and in any phase of the fit
        elif not any(counts[r] > 0 for r in active):
            return None  # nobody has stepped yet in this fit, or everybody is done
        else:
            low = min(counts[r] for r in active)
            behind = [r for r in active if counts[r] == low]
        waiting = [r for r in range(self.world_size) if r not in behind]
        state = (
            f"{_ranks(behind)} {'is' if len(behind) == 1 else 'are'} stopped (SIGSTOP) and "
            if stopped
            else f"{_ranks(behind)} "
        )
        if waiting:
            what = (
                f"{state}{'has' if len(behind) == 1 else 'have'} kept "
                f"{_ranks(waiting)} waiting for {still:.0f}s"
            )
        elif stopped:
            what = f"{state}no rank has made progress for {still:.0f}s"
        else:
            what = f"no rank has made progress for {still:.0f}s ({_ranks(behind)})"
        if still >= self.fail_after:
            reason = f"is stuck: {what} ({TIMEOUT}={self.fail_after:g})"
            return behind[0], reason, self.stack(behind[0])
        if not self.warned:
            self.warned = True
            lines = [
                f"cardcage: {what} ({STUCK_WARN}={self.warn_after:g}); the job fails after "
                f"{self.fail_after:g}s ({TIMEOUT})."
            ]
            for rank in behind:
                lines.append(f"--- stack of rank {rank} (pid {self.pid(rank)}) ---")
                lines.append(self.stack(rank).rstrip() or "(it did not answer)")
            print("\n".join(lines), file=sys.stderr, flush=True)
        return None

    def split(self, calls: list[int], now: float) -> tuple[int, str, str] | None:
        """``(rank, reason, stacks)`` when ranks sit in different Cage collectives: the
        collective most ranks are in (the first entered, on a tie) is the one the others
        did not call; ``None`` when every rank inside one is inside the same kind."""
        inside = {r: (c >> 4, c & 15) for r, c in enumerate(calls) if c > 0}
        groups: dict[int, list[int]] = {}
        for rank, (_, kind) in inside.items():
            if kind != RETURNED:
                groups.setdefault(kind, []).append(rank)
        if not groups or (len(groups) == 1 and len(inside) == sum(map(len, groups.values()))):
            return None
        kind = max(
            groups,
            key=lambda k: (
                len(groups[k]),
                -min(self.entered[r] for r in groups[k]),
                -min(groups[k]),
            ),
        )
        callers = groups[kind]
        missing = [r for r in inside if r not in callers]
        name = CALLS[kind]
        numbers = "/".join(f"#{n}" for n in sorted({inside[r][0] for r in callers}))
        waited = now - min(self.entered[r] for r in callers)

        def doing(rank: int) -> str:
            number, other = inside[rank]
            if other == RETURNED:
                return (
                    f"rank {rank} has returned from the function that cage.launch runs "
                    "(it waits to hand back its value)"
                )
            return f"rank {rank} is in {CALLS[other]} (its Cage collective #{number})"

        late = [r for r in range(self.world_size) if r not in inside and r not in missing]
        reason = (
            f"did not call {name}: {_ranks(callers)} called it "
            f"({'its' if len(callers) == 1 else 'their'} Cage collective {numbers}) "
            f"and {'has' if len(callers) == 1 else 'have'} waited in it for {waited:.0f}s, "
            f"while {'; '.join(doing(r) for r in missing)}"
            + (f" ({_ranks(late)}: in no Cage collective)" if late else "")
            + ". Every rank must call the Cage's collectives (barrier, all_reduce, "
            "all_gather, broadcast, save, and backward where it synchronizes gradients) "
            "the same number of times, in the same order: one that only some ranks call "
            f"waits for the others until {TIMEOUT} ({self.fail_after:g}s)"
        )
        blamed = missing[0]
        details = [self.stack(blamed).rstrip() or "(it did not answer)"]
        for rank in callers:
            details.append(f"--- stack of rank {rank} (in {name}) ---")
            details.append(self.stack(rank).rstrip() or "(it did not answer)")
        return blamed, reason, "\n".join(details)

    def stack(self, rank: int, wait_s: float = 2.0) -> str:
        """The Python stacks of ``rank``'s threads, as it dumps them on request (a stopped
        rank cannot: what it would take to resume it instead)."""
        path = self.folder / f"stack-{rank}.txt"
        pid = self.pid(rank)
        if pid <= 0:
            return ""
        if rank in self.stopped():
            return f"(it is stopped and cannot answer; `kill -CONT {pid}` resumes it)"
        try:
            before = path.stat().st_size
        except OSError:
            return "(its fit has not begun, so it has no stack handler yet)"
        try:
            os.kill(pid, STACK_SIGNAL)
        except OSError:
            return ""
        deadline = time.monotonic() + wait_s
        size = before
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now = path.stat().st_size
            if now > before and now == size:
                break  # it grew, and stopped growing
            size = now
        with open(path, "rb") as stream:
            stream.seek(before)
            return stream.read().decode(errors="replace")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
