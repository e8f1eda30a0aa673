"""Supervision of a launcher's children: none outlives a failure, the first failure is named.

- a child that exits non-zero (or is killed) stops every other child within seconds, and the
  launcher raises :class:`~cardcage.errors.RankFailedError` naming the first failing rank
  with its traceback (children write it to an error file,
  :mod:`cardcage.backend.launch.error_files`);
- so does a child that exits with status 0 before it finished the fit this launcher runs
  (each child counts the fits it finished,
  :func:`~cardcage.backend.launch.error_files.fits_finished`): it left the job early, and the
  peers that failed because it was gone are not blamed;
- SIGINT, SIGTERM and SIGHUP to the launcher stop all of its children first (a signal the
  script ignores, ``nohup``'s SIGHUP, stays ignored);
- children die with their launcher (``PR_SET_PDEATHSIG``), so even ``kill -9`` of the
  launcher leaves nothing behind;
- a rank that keeps the others waiting is named with its stack, and fails the job after
  ``CARDCAGE_TIMEOUT`` (:mod:`cardcage.backend.launch.watchdog`, when the launcher started
  every rank);
- the watcher costs nothing per training step: no collective, no polling from the loop.
"""

from __future__ import annotations

import _thread
import contextlib
import ctypes
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from cardcage.backend.launch.error_files import fits_finished, left_early, read_error_file
from cardcage.backend.launch.rendezvous import arrival_key
from cardcage.backend.launch.watchdog import Watch
from cardcage.config import owners
from cardcage.config.variables import INIT_TIMEOUT, init_timeout
from cardcage.errors import RankFailedError

T = TypeVar("T")
STOP_GRACE_S = 3.0
#: How often the watcher looks at the children.
POLL_S = 0.1
#: How often the watcher reads the ranks' progress counts.
WATCH_S = 1.0
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, sig)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before prctl took effect
            os.kill(os.getpid(), sig)


#: How long a child seen exiting may take to give its exit status before it is judged.
EXIT_STATUS_WAIT_S = 2.0


@dataclass
class Child:
    """A process this launcher started, as one rank of the job."""

    rank: int
    pid: int
    poll: Callable[[], int | None]
    error_file: Path


@dataclass
class Failure:
    rank: int
    exitcode: int | None
    details: str = ""
    reason: str = ""
    when: float = float("inf")

    def error(self) -> RankFailedError:
        return RankFailedError(self.rank, self.exitcode, self.details, self.reason)


@dataclass
class Supervisor:
    """Watches this launcher's children from a thread; stops them all on the first failure."""

    children: list[Child] = field(default_factory=list)
    store: Any = None
    world_size: int = 0
    #: The ranks' progress counts, when this launcher started every rank of the job.
    watch: Watch | None = None
    failure: Failure | None = None
    signal_received: int | None = None
    #: The fits run under this supervisor so far (a child that exits before it finished as
    #: many has left the job early).
    runs: int = 0
    stopping: threading.Event = field(default_factory=threading.Event)
    in_fit: threading.Event = field(default_factory=threading.Event)
    acknowledged: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    #: When each child was last seen running (``time.monotonic()``).
    _alive_at: dict[int, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    #: Whether the watcher may interrupt the main thread (set while a fit runs there).
    _interruptible: bool = False
    #: The watcher asked for an interrupt that the main thread has not taken yet.
    _interrupt_pending: bool = False
    #: Signals reach the watcher through this socket (``signal.set_wakeup_fd``), whichever
    #: thread of the process the kernel delivers them to.
    _wakeup: tuple[socket.socket, socket.socket] | None = None

    def __post_init__(self) -> None:
        if self.watch is not None:  # a rank that has not attached yet is found by its pid
            self.watch.pids.update({child.rank: child.pid for child in self.children})

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="cardcage-supervisor", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        deadline = time.monotonic() + init_timeout()
        waiting = set(range(self.world_size)) if self.store is not None else set()
        looked = time.monotonic()
        while not self.stopping.is_set():
            caught = self._wait_signal(POLL_S)
            if caught is not None:
                self.signal_received = caught
                self._abort(None)
                return
            failed = self.first_failure()
            if failed is not None:
                self._abort(failed)
                return
            if waiting:
                waiting = {r for r in waiting if not self.store.check([arrival_key(r)])}
                if waiting and time.monotonic() > deadline:
                    self._abort(
                        Failure(
                            min(waiting),
                            None,
                            reason=f"never arrived: ranks {sorted(waiting)} "
                            f"did not reach the rendezvous within {init_timeout():.0f}s "
                            f"({INIT_TIMEOUT})",
                        )
                    )
                    return
            now = time.monotonic()
            if self.watch is not None and self.in_fit.is_set() and now - looked >= WATCH_S:
                looked = now
                stuck = self.watch.check(now)
                if stuck is not None:
                    self._abort(Failure(stuck[0], None, stuck[2], reason=stuck[1]))
                    return
            if (
                all(child.poll() is not None for child in self.children)
                and not self.in_fit.is_set()
            ):
                return  # every child finished cleanly and no fit is running

    def first_failure(self) -> Failure | None:
        """The failed child that failed first, or ``None`` while none has.

        A child failed when it exited with a non-zero status, was killed, or exited with
        status 0 before it finished the fit this supervisor runs (it left the job early).
        Its time of failure is the one its error file records. A child that ended without a
        word (killed from outside, ``os._exit``) leaves no file; it ended after it was last
        seen running and before its peers noticed its absence, so it counts from the last
        time it was seen running: a peer that failed because it was gone comes later. A
        process that has begun to exit (killed, its sockets closing) no longer counts as
        running, though its exit status cannot be read yet.
        """
        now = time.monotonic()
        failed = []
        for child in self.children:
            code = child.poll()
            if code is None and not owners.exiting(child.pid):
                self._alive_at[child.rank] = now  # running, not yet on its way out
            elif code != 0 or fits_finished(child.error_file) < self.runs:
                failed.append(child)
        if not failed:
            return None
        time.sleep(0.2)  # let ranks that fail as a consequence leave their files too
        failures = []
        offset = time.time() - time.monotonic()  # error files hold wall-clock times
        for child in failed:
            code = child.poll()
            # A child seen on its way out (its status not yet readable) may be one that
            # finished its fit and is exiting normally: wait for its status to know.
            deadline = time.monotonic() + EXIT_STATUS_WAIT_S
            while code is None and time.monotonic() < deadline:
                time.sleep(0.02)
                code = child.poll()
            if code == 0 and fits_finished(child.error_file) >= self.runs:
                continue  # it finished cleanly
            when, text = read_error_file(child.error_file)
            if not text:
                when = self._alive_at.get(child.rank, 0.0) + offset
            signalled = code is not None and code < 0
            early = code == 0 or not (text or signalled)
            reason = left_early(code) if early and code is not None else ""
            failures.append(Failure(child.rank, code, text, reason=reason, when=when))
        if not failures:
            return None
        return min(failures, key=lambda f: (f.when, f.rank))

    def _abort(self, failure: Failure | None) -> None:
        self.failure = failure
        stop_processes([c.pid for c in self.children], [c.poll for c in self.children])
        with self._lock:
            interrupt = self.in_fit.is_set() and self._interruptible
            if interrupt:
                self._interrupt_pending = True
                # Runs _on_signal in the main thread, which raises KeyboardInterrupt there.
                _thread.interrupt_main()
        if not interrupt:
            return
        # A main thread stuck inside a collective (NCCL) cannot take the interrupt: give it a
        # few seconds, then leave anyway rather than hang.
        if not self.acknowledged.wait(10.0):
            report = failure.error() if failure else f"signal {self.signal_received}"
            print(f"cardcage: {report}", file=sys.stderr, flush=True)
            os._exit(1)

    # -- signals ----------------------------------------------------------------------------
    #
    # Blocking SIGINT/SIGTERM in the main thread is not enough: threads that torch started
    # earlier (the hosted TCPStore's, gloo's) do not block them, and the kernel delivers a
    # process-directed signal to any such thread, whose default action kills the launcher
    # before it can stop its children. Instead, Python-level handlers are installed for the
    # fit: the C-level handler writes the signal number to a wakeup socket (whichever thread
    # the kernel picked), the watcher reads it there, stops the children and then interrupts
    # the main thread through the same handler, exactly once.

    def _on_signal(self, signum: int, frame: Any) -> None:
        """The Python-level SIGINT/SIGTERM handler during a fit (runs in the main thread)."""
        if self._interrupt_pending:  # the watcher's interrupt_main(), after it stopped all
            self._interrupt_pending = False
            raise KeyboardInterrupt
        # A real signal: the watcher got it from the wakeup socket and stops the job.

    def _catch_signals(self) -> Callable[[], None] | None:
        """Route SIGINT/SIGTERM to the watcher; returns what restores the previous state."""
        if self._wakeup is None:
            pair = socket.socketpair()
            for end in pair:
                end.setblocking(False)
            self._wakeup = pair
        reader, writer = self._wakeup
        with contextlib.suppress(OSError):  # stale bytes (an earlier fit's interrupt)
            while reader.recv(4096):
                pass
        try:
            previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main thread
            return None
        caught = [sig for sig in SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN]
        previous = {sig: signal.signal(sig, self._on_signal) for sig in caught}

        def restore() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
            signal.set_wakeup_fd(previous_fd)

        return restore

    def _wait_signal(self, timeout: float) -> int | None:
        """A SIGINT/SIGTERM the launcher received, waiting up to ``timeout`` seconds."""
        wakeup = self._wakeup
        if wakeup is None:
            time.sleep(timeout)
            return None
        try:
            ready, _, _ = select.select([wakeup[0]], [], [], timeout)
            data = wakeup[0].recv(4096) if ready else b""
        except (OSError, ValueError):
            return None
        for number in data:
            if number in SIGNALS:
                return number
        return None

    def run(self, function: Callable[[], T]) -> T:
        """Run ``function`` (a fit, or waiting for spawned workers) under supervision.

        A failing child or a SIGINT/SIGTERM stops every child; then the launcher raises
        :class:`~cardcage.errors.RankFailedError` (or exits with 128 + the signal number).
        The watcher's interrupt of the main thread is taken here wherever it lands, inside
        ``function`` or while this method settles after it: never in the caller.
        """
        main = threading.current_thread() is threading.main_thread()
        restore = self._catch_signals() if main else None
        with self._lock:
            self._interruptible = restore is not None
            self._interrupt_pending = False
        if self.watch is not None:
            self.watch.restart()
        self.runs += 1
        self.in_fit.set()
        self.acknowledged.clear()
        if self._thread is None or not self._thread.is_alive():
            self.start()
        error: BaseException | None = None
        outcome: BaseException | None = None
        result: Any = None
        try:
            try:
                result = function()
            except BaseException as caught:
                error = caught
            ended_at = time.time()
            while True:
                try:
                    with self._lock:  # from here on no interrupt is sent or taken
                        self._interruptible = False
                        self._interrupt_pending = False
                    break
                except KeyboardInterrupt:  # the watcher's interrupt landed just now
                    continue
            self.acknowledged.set()
            outcome = self._outcome(error, ended_at)
        finally:
            self.in_fit.clear()
            self.acknowledged.set()
            if restore is not None:
                restore()
        if outcome is not None:
            raise outcome from error
        if error is not None:
            raise error
        return result  # type: ignore[no-any-return]

    def _outcome(self, error: BaseException | None, ended_at: float) -> BaseException | None:
        """What the launcher raises after a fit that ended with ``error`` (None: returned)."""
        if error is None and self.failure is None and self.signal_received is None:
            return None
        if self.failure is None and self.signal_received is None:
            # A rank that fails takes its peers down with it: give the watcher a moment
            # to see a child's exit before calling this process the cause.
            # A child that left a traceback is on its way out, however slowly a loaded
            # machine lets it finish: wait for its exit a while longer.
            failed = None
            deadline, extended = time.monotonic() + 2.0, False
            while time.monotonic() < deadline:
                failed = self.failure or self.first_failure()
                if failed is not None or self.signal_received is not None:
                    break
                if not extended and any(
                    c.poll() is None and c.error_file.exists() for c in self.children
                ):
                    deadline, extended = time.monotonic() + STOP_GRACE_S * 3, True
                time.sleep(0.1)
            # A killed child left no traceback and is never a consequence of this error.
            if failed is not None and (failed.when <= ended_at or not failed.details):
                self.failure = failed
        stop_processes([c.pid for c in self.children], [c.poll for c in self.children])
        if self.signal_received is not None:
            return SystemExit(128 + self.signal_received)
        if self.failure is not None:
            return self.failure.error()
        return None


def stop_processes(pids: Sequence[int], polls: Sequence[Callable[[], int | None]]) -> None:
    """SIGTERM every live process, then SIGKILL those still alive after a grace period."""
    alive = [pid for pid, poll in zip(pids, polls, strict=True) if poll() is None]
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGCONT)  # a stopped process takes its SIGTERM now
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and any(p() is None for p in polls):
        time.sleep(0.05)
    for pid, poll in zip(pids, polls, strict=True):
        if poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for poll in polls:
        poll()
