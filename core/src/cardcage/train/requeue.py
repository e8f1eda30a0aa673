"""Checkpoint and requeue on the scheduler's warning signal (SLURM: ``--signal=USR1@90``).

When the cluster environment can requeue its job (``ClusterEnvironment.requeue_signal()`` is
not ``None``; for SLURM managing tasks it is ``SIGUSR1``, or ``CARDCAGE_REQUEUE_SIGNAL``),
every training process installs a handler for that signal when ``fit`` starts. On the signal:

1. The handler only sets a :class:`threading.Event`.
2. The ranks agree on a step to stop at, off the training loop and without a collective.
   Each rank runs a *watcher* thread, with its own connection to the job's rendezvous store
   (the TCPStore of the process group), blocked on the key ``request``; a *signaller* thread
   blocked on the event adds 1 to that key, so one signalled rank is enough. Every watcher
   wakes and reports its ``global_step`` and step rate (during an agreement, which lasts
   milliseconds, watchers poll the store every 5 ms rather than block in it, so that a fit
   that ends mid-agreement can always stop its threads). Rank 0's watcher picks
   ``S = max(reported) + 1 + margin`` (the margin: the steps the fastest rank does in
   0.25 s) and publishes it. Each watcher writes ``S`` to ``trainer.stop_at_step``, reads
   ``global_step`` again and acknowledges ``ok`` (still below ``S``: the loop will see it)
   or ``late``. Rank 0 commits ``S`` when every rank is ``ok``; otherwise it publishes a
   later step (a new round, with twice the margin) and every rank carries on to that one.
3. The loop compares ``trainer.global_step == trainer.stop_at_step`` after each step: one
   attribute read, the only cost while training. A rank that reaches ``S`` waits (on the
   store) for rank 0's decision about it: carry on to a later step, or commit.
4. Commit: every rank gathers the checkpoint state (the backend's ``gather_state``, where a
   sharded backend may run collectives); rank 0 writes it atomically (model, optimizers,
   epoch, position in the epoch, random state), then requeues the job (``scontrol requeue
   $SLURM_JOB_ID``). Every rank then leaves ``fit`` with :class:`Requeued`, a
   ``SystemExit`` with status 75.
5. The requeued job runs the script again. With ``SLURM_RESTART_COUNT > 0`` and the
   checkpoint present, ``fit`` resumes from it, whatever ``resume_from_checkpoint`` says.

The checkpoint is ``cardcage-requeue-<job id>.ckpt`` in ``CARDCAGE_REQUEUE_DIR``, else the
Trainer's ``default_root_dir``, else the job's submit folder (``SLURM_SUBMIT_DIR``). One
process needs no store: its signaller picks ``global_step + 1`` the same way. A signal that
arrives while no ``fit`` runs is ignored (the handler stays installed).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from cardcage.checkpoints import io as checkpoint
from cardcage.errors import CheckpointError
from cardcage.train.stop_step import AGREE_TIMEOUT, DONE, FOREVER, NEVER, agree, say

if TYPE_CHECKING:
    from cardcage.backend.selection_types import Selection
    from cardcage.backend.trainer_protocol import TrainerProtocol as Trainer
    from cardcage.environments.base import ClusterEnvironment

log = logging.getLogger("cardcage")

REQUEUE_DIR = "CARDCAGE_REQUEUE_DIR"
#: The exit status of every rank after a requeue (``EX_TEMPFAIL``: try again later).
REQUEUED_EXIT_STATUS = 75
SAVE_TIMEOUT = timedelta(hours=1)
#: Starts the result rank 0 publishes when it could not write the requeue checkpoint.
FAILED = "failed: "


class Requeued(SystemExit):
    """Raised from ``fit`` in every rank once the requeue checkpoint is written.

    ``code`` is :data:`REQUEUED_EXIT_STATUS`; ``message`` says what happened to the job.
    """

    def __init__(self, message: str):
        super().__init__(REQUEUED_EXIT_STATUS)
        self.message = message

    def __str__(self) -> str:
        return self.message


def check(selection: Selection) -> None:
    """Validate the requeue settings when the Trainer is built (a bad signal name raises)."""
    if selection.environment is not None:
        selection.environment.requeue_signal()


def checkpoint_path(environment: ClusterEnvironment, default_root_dir: str | None) -> Path:
    """Where this job's requeue checkpoint lives."""
    folder = (
        environment.env.get(REQUEUE_DIR)
        or default_root_dir
        or environment.requeue_dir()
        or os.getcwd()
    )
    return Path(folder) / f"cardcage-requeue-{environment.job_id() or 'job'}.ckpt"


# -- the signal handler -----------------------------------------------------------------------

_active: RequeueHandler | None = None
_previous: dict[int, Any] = {}
_fits = 0


def _on_signal(signum: int, frame: FrameType | None) -> None:
    handler = _active
    if handler is not None and handler.signal == signum:
        handler.requested.set()
    previous = _previous.get(signum)
    if callable(previous):
        previous(signum, frame)


def _install(sig: signal.Signals) -> bool:
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(sig)
    if current is not _on_signal:
        _previous[sig] = current
        signal.signal(sig, _on_signal)
    return True


def handler_for(trainer: Trainer) -> RequeueHandler | None:
    """Install the requeue signal handler for this fit, when the environment can requeue."""
    global _active
    environment = trainer.selection.environment
    if environment is None:
        return None
    sig = environment.requeue_signal()
    if sig is None:
        return None
    if not _install(sig):
        log.warning("cardcage: fit runs outside the main thread: no %s handler", sig.name)
        return None
    handler = RequeueHandler(
        environment, sig, checkpoint_path(environment, trainer.flags.default_root_dir)
    )
    _active = handler
    return handler


def _tcp_store() -> Any | None:
    """The TCPStore under the default process group's store, if there is one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    store: Any = dist.distributed_c10d._get_default_store()
    for _ in range(8):
        if isinstance(store, TCPStore):
            return store
        store = getattr(store, "underlying_store", None)
        if store is None:
            return None
    return None


class RequeueHandler:
    """One fit's part in checkpoint-and-requeue: the threads, the stop step, the commit."""

    def __init__(self, environment: ClusterEnvironment, sig: signal.Signals, path: Path):
        self.environment = environment
        self.signal = sig
        self.path = path
        self.requested = threading.Event()
        self.closed = threading.Event()
        self.rank = 0
        self.world_size = 1
        self.prefix = ""
        self.store: Any = None  # the process group's TCPStore (main and signaller threads)
        self.rounds: dict[int, int] = {}  # stop step -> agreement round
        self.baseline = (time.monotonic(), 0)
        self.resumed = False
        self.trainer: Trainer | None = None
        self.threads: list[threading.Thread] = []

    # -- start of fit -----------------------------------------------------------------------

    def resume_path(self, requested: str | None, rank: int, job: str | None = None) -> str | None:
        """The checkpoint to resume from: this job's requeue checkpoint on a restart.

        ``job``: this fit's cluster job (:func:`cardcage.backend.launch.restarts.cluster_job`); a
        file that records another (or none: an older cardcage's) is not this job's, whatever its
        name.
        """
        if not self.path.exists():
            return requested
        restarts = self.environment.restart_count()
        if restarts > 0 and job is not None:
            record = checkpoint.recorded_run(self.path)
            if not isinstance(record, dict) or record.get("job") != job:
                if rank == 0:
                    whose = record if isinstance(record, str) else f"it is {record.get('job')}'s"
                    say(f"ignoring {self.path}: it names this job id, but {whose}, not {job}'s")
                return requested
        if restarts > 0:
            self.resumed = True
            return str(self.path)
        if rank == 0:
            say(
                f"ignoring {self.path}: it names this job id, but this is the job's first run "
                "(restart count 0); it was left by an earlier job with the same id"
            )
        return requested

    def start(self, trainer: Trainer) -> None:
        """Start the threads of this fit (after setup and any resume)."""
        global _fits, _active
        accelerator = trainer.accelerator
        self.trainer = trainer
        self.rank, self.world_size = accelerator.global_rank, accelerator.world_size
        trainer.stop_at_step = NEVER
        self.baseline = (time.monotonic(), trainer.global_step)
        _fits += 1
        self.prefix = f"cardcage/requeue/{_fits}/"
        if self.resumed and self.rank == 0:
            say(
                f"job {self.environment.job_id()} restart {self.environment.restart_count()}: "
                f"resumed from {self.path} at global step {trainer.global_step} (epoch "
                f"{trainer.current_epoch}, batch {trainer.batch_idx})"
            )
        threads: list[tuple[str, Any]] = []
        if self.world_size > 1:
            store = _tcp_store()
            if store is None:
                _active = None
                if self.rank == 0:
                    say(
                        f"{self.world_size} processes but no TCPStore rendezvous to agree "
                        f"through: {self.signal.name} will not checkpoint and requeue"
                    )
                return
            from torch.distributed import TCPStore  # type: ignore[attr-defined]

            self.store = store
            watcher_store = TCPStore(
                store.host, store.port, is_master=False, wait_for_workers=False, timeout=FOREVER
            )
            threads = [
                ("watcher", lambda: self._watch(watcher_store)),
                ("signaller", self._signaller),
            ]
        else:
            threads = [("signaller", self._local)]
        for name, target in threads:
            thread = threading.Thread(target=target, name=f"cardcage-requeue-{name}", daemon=True)
            thread.start()
            self.threads.append(thread)

    def close(self) -> None:
        """End of fit: the handler goes inert and every thread of this fit ends."""
        global _active
        if _active is self:
            _active = None  # first: the signal handler must not touch the event below
        self.closed.set()
        self.requested.set()
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.add(self.prefix + "request", DONE)  # wakes this rank's watcher
        # A thread still inside a store call when the interpreter exits aborts the process
        # ("terminate called without an active exception"): let them finish first.
        for thread in self.threads:
            thread.join(timeout=10)
        self.threads = []

    # -- the threads ------------------------------------------------------------------------

    def _received(self) -> None:
        trainer = self.trainer
        step = trainer.global_step if trainer is not None else 0
        say(f"rank {self.rank} received {self.signal.name} at global step {step}")

    def _local(self) -> None:
        """One process: stop at the next step the loop has not reached yet."""
        self.requested.wait()
        trainer = self.trainer
        if self.closed.is_set() or trainer is None:
            return
        self._received()
        margin = 1
        while not self.closed.is_set():
            stop = trainer.global_step + margin
            self.rounds[stop] = 0
            trainer.stop_at_step = stop
            if trainer.global_step < stop:  # read after the write: the loop will see it
                return
            margin *= 2

    def _signaller(self) -> None:
        self.requested.wait()
        if self.closed.is_set():
            return
        self._received()
        try:
            self.store.add(self.prefix + "request", 1)
        except Exception as error:
            say(f"rank {self.rank} could not reach the job's store to ask for a stop: {error}")

    def _watch(self, client: Any) -> None:
        try:
            agree(self, client)
        except Exception as error:
            if not self.closed.is_set():
                say(f"rank {self.rank}: agreeing on a stop step failed: {error}")

    # -- the loop's call at the stop step ---------------------------------------------------

    def at_stop_step(self, trainer: Trainer) -> None:
        """Called by the loop when ``global_step == stop_at_step``: go on, or checkpoint."""
        step = trainer.global_step
        if self.world_size > 1:
            round_ = self.rounds[step]
            key = f"{self.prefix}decision/{round_}"
            self.store.wait([key], AGREE_TIMEOUT)
            decision = self.store.get(key).decode()
            if decision == "abort":
                trainer.stop_at_step = NEVER
                return
            if decision.startswith("retry"):
                later = int(decision.split()[1])
                self.rounds[later] = round_ + 1
                trainer.stop_at_step = later
                return
        self._commit(trainer)

    def _commit(self, trainer: Trainer) -> None:
        trainer.in_epoch = False  # the step is over: resume draws the next batch afresh
        job = self.environment.job_id()
        state = trainer.checkpoint_state()  # every rank: a sharded backend gathers here
        if self.rank == 0:
            try:
                if state is None:
                    raise CheckpointError(
                        f"{type(trainer.accelerator).__name__}.gather_state returned None on "
                        "rank 0, which writes the requeue checkpoint: return the full state there"
                    )
                checkpoint.save_atomic(state, self.path)
            except CheckpointError as error:
                # No checkpoint, so no requeue: every rank fails with the cause, now (the
                # others would otherwise wait SAVE_TIMEOUT for a result).
                failed = f"job {job} was not requeued: {error}"
                say(failed)
                if self.store is not None:
                    self.store.set(self.prefix + "result", FAILED + failed)
                    self._wait_for_readers()
                raise CheckpointError(failed, error.path, error.errno) from error
            say(
                f"checkpoint at global step {trainer.global_step} (epoch "
                f"{trainer.current_epoch}, batch {trainer.batch_idx}) written to {self.path}"
            )
            try:
                self.environment.requeue()
                result = f"requeued job {job}; it resumes from the checkpoint when it restarts"
            except Exception as error:
                result = (
                    f"could not requeue job {job} ({error}); the checkpoint stays: pass "
                    f"resume_from_checkpoint={str(self.path)!r} to continue"
                )
            say(result)
            if self.store is not None:
                self.store.set(self.prefix + "result", result)
                self._wait_for_readers()
        else:
            key = self.prefix + "result"
            self.store.wait([key], SAVE_TIMEOUT)
            result = self.store.get(key).decode()
            self.store.add(self.prefix + "left", 1)
            if result.startswith(FAILED):
                raise CheckpointError(result.removeprefix(FAILED), str(self.path))
        raise Requeued(result)

    def _wait_for_readers(self) -> None:
        """This process hosts the store: let the others read the result first."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if int(self.store.add(self.prefix + "left", 0)) >= self.world_size - 1:
                break
            time.sleep(0.05)
