"""Starting the processes of a job on this node and making sure none outlives a failure.

Two launchers: :func:`relaunch_script` re-runs the user's script once per extra local rank
(the launching process trains as local rank 0, as in Lightning 1.0), and :func:`spawn`
starts workers with ``torch.multiprocessing``'s spawn context. Both put the children under a
:class:`Supervisor`:

- a child that exits non-zero (or is killed) stops every other child within seconds, and the
  launcher raises :class:`~cardcage.errors.RankFailedError` naming the first failing rank
  with its traceback (children write it to an error file);
- SIGINT and SIGTERM to the launcher stop all of its children first;
- children die with their launcher (``PR_SET_PDEATHSIG``), so even ``kill -9`` of the
  launcher leaves nothing behind;
- the watcher costs nothing per training step: no collective, no polling from the loop.

When no ``MASTER_PORT`` is set on a single node, the launcher hosts the rendezvous
``TCPStore`` on a port the kernel picks (port 0), so two jobs started at once never race for
a port; ranks then report their arrival, and a rank that never arrives is named.
"""

from __future__ import annotations

import _thread
import atexit
import contextlib
import ctypes
import logging
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from cardcage.errors import MisconfigurationError, RankFailedError

log = logging.getLogger("cardcage")
T = TypeVar("T")

ERROR_FILE = "CARDCAGE_ERROR_FILE"
HOSTED_STORE = "CARDCAGE_HOSTED_STORE"
INIT_TIMEOUT = "CARDCAGE_INIT_TIMEOUT"
STOP_GRACE_S = 3.0
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def init_timeout() -> float:
    """Seconds every rank may take to arrive (``CARDCAGE_INIT_TIMEOUT``, default 300)."""
    raw = os.environ.get(INIT_TIMEOUT, "300")
    try:
        value = float(raw)
    except ValueError:
        raise MisconfigurationError(
            f"environment variable {INIT_TIMEOUT}={raw!r} is not a number of seconds."
        ) from None
    return value


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, sig)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before prctl took effect
            os.kill(os.getpid(), sig)


def write_error_file(error: BaseException) -> None:
    """Record this rank's traceback (and when it failed) for the launcher's report."""
    path = os.environ.get(ERROR_FILE)
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


# -- the rendezvous store -------------------------------------------------------------------

_hosted: dict[str, Any] = {}


def host_store(world_size: int) -> Any:
    """Host the job's TCPStore in this process on a free port (kernel-chosen, no race)."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    store = TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=init_timeout()),
    )
    _hosted["store"] = store
    return store


def hosted_store() -> Any | None:
    """The store this process hosts, if it hosts one."""
    return _hosted.get("store")


def arrival_key(rank: int) -> str:
    return f"cardcage/arrived/{rank}"


# -- supervision ------------------------------------------------------------------------------


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
    failure: Failure | None = None
    signal_received: int | None = None
    stopping: threading.Event = field(default_factory=threading.Event)
    in_fit: threading.Event = field(default_factory=threading.Event)
    acknowledged: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    #: Whether the watcher may interrupt the main thread (set while a fit runs there).
    _interruptible: bool = False
    #: The watcher asked for an interrupt that the main thread has not taken yet.
    _interrupt_pending: bool = False
    #: Signals reach the watcher through this socket (``signal.set_wakeup_fd``), whichever
    #: thread of the process the kernel delivers them to.
    _wakeup: tuple[socket.socket, socket.socket] | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="cardcage-supervisor", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        deadline = time.monotonic() + init_timeout()
        waiting = set(range(self.world_size)) if self.store is not None else set()
        while not self.stopping.is_set():
            caught = self._wait_signal(0.1)
            if caught is not None:
                self.signal_received = caught
                self._abort(None)
                return
            failed = self._first_failure()
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
            if (
                all(child.poll() is not None for child in self.children)
                and not self.in_fit.is_set()
            ):
                return  # every child finished cleanly and no fit is running

    def _first_failure(self) -> Failure | None:
        failures = []
        for child in self.children:
            code = child.poll()
            if code not in (None, 0):
                when, text = read_error_file(child.error_file)
                failures.append(Failure(child.rank, code, text, when=when))
        if not failures:
            return None
        time.sleep(0.2)  # let ranks that fail as a consequence leave their files too
        for failure in failures:
            failure.when, text = read_error_file(
                next(c for c in self.children if c.rank == failure.rank).error_file
            )
            failure.details = text or failure.details
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
        previous = {sig: signal.signal(sig, self._on_signal) for sig in SIGNALS}

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
                failed = self.failure or self._first_failure()
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
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and any(p() is None for p in polls):
        time.sleep(0.05)
    for pid, poll in zip(pids, polls, strict=True):
        if poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for poll in polls:
        poll()


# -- script relaunch (ddp) --------------------------------------------------------------------

_relaunched: dict[str, Supervisor] = {}
DEFAULT_ADDRESS = "127.0.0.1"


def current_supervisor() -> Supervisor | None:
    """The supervisor of the processes this script already relaunched, if any."""
    return _relaunched.get("supervisor")


def script_command() -> list[str]:
    """How to run the user's script again: ``python script.py args`` or ``python -m mod``."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name not in ("__main__", None):
        return [sys.executable, "-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]]
    script = sys.argv[0] if sys.argv else ""
    if not script or script == "-c" or not os.path.exists(script):
        raise MisconfigurationError(
            "distributed_backend='ddp' starts its processes by running your script again, "
            f"but this process has no script (sys.argv[0]={script!r}: an interactive session, "
            "a notebook or python -c). Use distributed_backend='ddp_spawn' there, or run a "
            "script."
        )
    return [sys.executable, os.path.abspath(script), *sys.argv[1:]]


def relaunch_script(
    *,
    node_rank: int,
    processes_per_node: int,
    num_nodes: int,
    master_address: str,
    master_port: int | None,
    gpu_ids: list[int] | None,
) -> Supervisor:
    """Start local ranks 1..n-1 of this node by re-running the script; this process is 0.

    Afterwards this process's environment says it is local rank 0 of a launched job, so a
    second ``fit`` (or a new Trainer) in the script joins the same processes instead of
    launching again.
    """
    import subprocess

    if "supervisor" in _relaunched:
        return _relaunched["supervisor"]
    world_size = processes_per_node * num_nodes
    base_rank = node_rank * processes_per_node
    env = dict(os.environ)
    command = script_command()
    hosted = master_port is None
    if hosted:
        if num_nodes > 1:
            raise MisconfigurationError(
                f"num_nodes={num_nodes} launched by hand needs MASTER_PORT (and MASTER_ADDR) "
                "set to the same values on every node. Set them, or launch with torchrun/srun."
            )
        store = host_store(world_size)
        master_port = int(store.port)
        env[HOSTED_STORE] = "1"
    errors = Path(tempfile.mkdtemp(prefix="cardcage-errors-"))
    atexit.register(shutil.rmtree, errors, True)  # the children's error files, once read
    env.update(
        {
            "MASTER_ADDR": master_address,
            "MASTER_PORT": str(master_port),
            "WORLD_SIZE": str(world_size),
            "NODE_RANK": str(node_rank),
            "GROUP_RANK": str(node_rank),
            "LOCAL_WORLD_SIZE": str(processes_per_node),
        }
    )
    if gpu_ids:
        env["CARDCAGE_GPUS"] = ",".join(str(i) for i in gpu_ids)
    children = []
    for local_rank in range(1, processes_per_node):
        child_env = {
            **env,
            "LOCAL_RANK": str(local_rank),
            "RANK": str(base_rank + local_rank),
            ERROR_FILE: str(errors / f"rank-{base_rank + local_rank}.txt"),
        }
        process = subprocess.Popen(
            command,
            env=child_env,
            cwd=os.getcwd(),
            preexec_fn=_child_preexec,
        )
        children.append(
            Child(
                base_rank + local_rank,
                process.pid,
                process.poll,
                errors / f"rank-{base_rank + local_rank}.txt",
            )
        )
    # This process is local rank 0 from now on: a later fit joins these processes.
    os.environ.update(env)
    os.environ.update({"LOCAL_RANK": "0", "RANK": str(base_rank)})
    supervisor = Supervisor(
        children, store=hosted_store() if hosted else None, world_size=world_size if hosted else 0
    )
    _relaunched["supervisor"] = supervisor
    log.info(
        "cardcage: started %d process(es) on node %d by re-running %s",
        len(children),
        node_rank,
        " ".join(command),
    )
    return supervisor


def _child_preexec() -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, [])  # whatever mask the launching thread had
    set_parent_death_signal()


# -- spawn (ddp_spawn) ----------------------------------------------------------------------


def spawn(
    worker: Callable[..., None],
    nprocs: int,
    args: tuple[Any, ...],
    *,
    node_rank: int,
    num_nodes: int,
    master_address: str,
    master_port: int | None,
) -> Path:
    """Start ``worker(local_rank, rank_env, *args)`` in ``nprocs`` spawned processes and wait.

    Returns the folder where rank 0 leaves its results. Raises
    :class:`~cardcage.errors.RankFailedError` when a worker fails.
    """
    import multiprocessing

    world_size = nprocs * num_nodes
    hosted = master_port is None
    if hosted:
        if num_nodes > 1:
            raise MisconfigurationError(
                f"num_nodes={num_nodes} launched by hand needs MASTER_PORT (and MASTER_ADDR) "
                "set to the same values on every node."
            )
        master_port = int(host_store(world_size).port)
    folder = Path(tempfile.mkdtemp(prefix="cardcage-spawn-"))
    context = multiprocessing.get_context("spawn")
    children = []
    for local_rank in range(nprocs):
        rank = node_rank * nprocs + local_rank
        rank_env = {
            "MASTER_ADDR": master_address,
            "MASTER_PORT": str(master_port),
            "WORLD_SIZE": str(world_size),
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "NODE_RANK": str(node_rank),
            "GROUP_RANK": str(node_rank),
            "LOCAL_WORLD_SIZE": str(nprocs),
            ERROR_FILE: str(folder / f"rank-{rank}.txt"),
        }
        if hosted:
            rank_env[HOSTED_STORE] = "1"
        process = context.Process(
            target=worker, args=(local_rank, rank_env, *args), name=f"cardcage-rank-{rank}"
        )
        process.start()
        children.append(
            Child(rank, process.pid or 0, _exitcode(process), folder / f"rank-{rank}.txt")
        )
    supervisor = Supervisor(
        children, store=hosted_store() if hosted else None, world_size=world_size if hosted else 0
    )

    def wait() -> None:
        while any(child.poll() is None for child in children):
            time.sleep(0.05)

    try:
        supervisor.run(wait)
        # Workers that failed while this process was leaving the wait are failures too
        # (the watcher may have recorded one already).
        failed = supervisor.failure or supervisor._first_failure()
        if failed is not None:
            raise failed.error()
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)  # the error files are read by now
        raise
    finally:
        _hosted.pop("store", None)
    return folder


def _exitcode(process: Any) -> Callable[[], int | None]:
    def poll() -> int | None:
        code: int | None = process.exitcode
        return code

    return poll


def spawned_worker_start(rank_env: dict[str, str]) -> None:
    """First thing in a spawned worker: its rank variables, and death with the launcher."""
    set_parent_death_signal()
    os.environ.update(rank_env)


def result_path() -> Path:
    """Where a spawned worker leaves its results for the launcher."""
    return Path(os.environ[ERROR_FILE]).parent / f"result-node{os.environ.get('NODE_RANK', '0')}.pt"
