"""Checkpoints written atomically and read with ``weights_only=True``.

A checkpoint holds the model, the optimizers, the grad scaler, the epoch, the global step,
the position inside the epoch and the random states needed to draw the same batches again.
It is written to a temporary file in the target folder, flushed to disk, then renamed over
the target: a crash mid-write leaves the previous checkpoint whole. The temporary file's name
names its writer (``.last.ckpt.<pid>.<start>@<host>.<random>.tmp``, as
:func:`cardcage.config.owners.owner` names a process): a write stopped by
SIGTERM, SIGINT or SIGHUP removes it before the process ends, and :func:`clear_partial_files`
removes those whose writer was killed outright (SIGKILL), never one that a live process, of
this job or another, is still writing.

Checking ``resume_from_checkpoint`` before anything starts, and reading a checkpoint file
with every failure explained (what :func:`load` does), are in
:mod:`cardcage.checkpoints.validation`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import random
import re
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from cardcage.checkpoints import validation
from cardcage.checkpoints.validation import LOOP_FILE, Checked
from cardcage.config import owners
from cardcage.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class Run:
    """The run a ``fit`` belongs to, as the checkpoints it writes record it (``"run"``).

    ``fit``: one call of ``fit``, an id made in the calling process when it starts and
    carried to the processes it starts; ``max_restarts`` resumes only from its checkpoints.
    ``job``: the cluster job that restarts its processes (torchrun's, SLURM's), the same in
    every attempt; its restarts resume only from its checkpoints. ``resume``: the checkpoint
    a cluster's restart of this job resumes from, decided when ``fit`` starts. See
    :mod:`cardcage.backend.launch.restarts`.
    """

    fit: str
    job: str | None = None
    resume: str | None = None

    def record(self) -> dict[str, str | None]:
        """What a checkpoint holds of it."""
        return {"fit": self.fit, "job": self.job}


def recorded_run(path: str | os.PathLike[str]) -> dict[str, Any] | str:
    """The run a checkpoint records (``{"fit": ..., "job": ...}``), or why there is none.

    Only the loop state is read (``mmap``: the tensors stay on disk). A folder is a backend's
    own format, whose loop state is its ``loop.pt``.
    """
    target = Path(path)
    if target.is_dir():
        target = target / LOOP_FILE
    try:
        state = torch.load(target, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        try:  # a file system without mmap: read it whole
            state = torch.load(target, map_location="cpu", weights_only=True)
        except Exception as error:
            return f"it cannot be read: {type(error).__name__}: {str(error)[:200]}"
    run = state.get("run") if isinstance(state, dict) else None
    if not isinstance(run, dict):
        return "it records no run: an earlier cardcage, or another program, wrote it"
    return run


def rng_state() -> dict[str, Any]:
    """The random states a resumed run needs (python, torch CPU, CUDA when initialised)."""
    version, state, gauss = random.getstate()
    states: dict[str, Any] = {
        "python": [version, list(state), gauss],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        states["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        kind, keys, pos, has_gauss, cached = numpy.random.get_state(legacy=True)  # type: ignore[misc]
        keys = numpy.asarray(keys, dtype="int64")
        states["numpy"] = [kind, torch.from_numpy(keys), pos, has_gauss, cached]
    except ImportError:
        pass
    return states


def set_rng_state(states: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    version, state, gauss = states["python"]
    random.setstate((version, tuple(state), gauss))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states:
        import numpy

        kind, keys, pos, has_gauss, cached = states["numpy"]
        numpy.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def save_atomic(payload: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``payload`` to ``path`` so that readers see the old file or the new one.

    A write that fails for want of space or permission (or any other ``OSError``) raises
    :class:`~cardcage.errors.CheckpointError` naming the path and the cause; the previous
    file at ``path`` stays whole and the partial temporary file is removed.
    """
    target = Path(path)
    if os.path.exists(target) and not os.path.isfile(target):
        # The rename would replace a folder's entry or a device (/dev/full) by a file.
        kind = "a folder" if os.path.isdir(target) else "a device, pipe or socket"
        raise CheckpointError(
            f"could not write checkpoint {target}: it is {kind}, not a file; nothing was "
            "written there. Fix: give the path of a file.",
            str(target),
        )
    partial = _Partial()
    with _removed_on_signal(partial):
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            handle, partial.path = tempfile.mkstemp(
                prefix=f".{target.name}.{owners.owner()}.", suffix=".tmp", dir=target.parent
            )
        except OSError as error:
            raise write_error(target, error) from error
        temporary = partial.path
        recorder = _Recorder()
        try:
            with os.fdopen(handle, "wb") as stream:
                recorder.stream = stream
                torch.save(payload, recorder)  # type: ignore[arg-type]  # write, flush suffice
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(temporary, target)
            partial.path = None
        except BaseException as error:
            partial.remove()
            if partial.signal is not None:  # Ctrl+C, which torch's writer may have hidden
                raise KeyboardInterrupt from error
            # torch reports a failed write as "unexpected pos 5504 vs 5398": find the OSError.
            cause = recorder.error or _os_error(error)
            if cause is None or not isinstance(error, Exception):
                raise
            raise write_error(target, cause) from cause
    try:
        directory = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself must reach the disk
        finally:
            os.close(directory)
    except OSError as error:
        raise write_error(target, error, written=True) from error
    return target


class _Partial:
    """The temporary file of one write in progress, and the signal that stopped it."""

    def __init__(self) -> None:
        self.path: str | None = None
        self.signal: int | None = None

    def remove(self) -> None:
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


@contextlib.contextmanager
def _removed_on_signal(partial: _Partial) -> Iterator[None]:
    """Within the block, SIGTERM, SIGHUP and SIGINT remove ``partial``'s file first, then act
    as they would have: SIGTERM and SIGHUP end the process (their default action, same exit
    status), SIGINT raises KeyboardInterrupt.

    The file is removed in the handler itself: an exception raised inside ``torch.save``'s
    writes does not stop it (torch carries on writing, and fails only at the end). Only
    signals left at Python's defaults and only in the main thread, where Python runs
    handlers: a handler of the program's own (the launcher's) is kept. Costs two
    ``signal.signal`` calls per signal and checkpoint."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    defaults = {
        sig: handler
        for sig, handler in (
            (signal.SIGTERM, signal.getsignal(signal.SIGTERM)),
            (signal.SIGHUP, signal.getsignal(signal.SIGHUP)),
            (signal.SIGINT, signal.getsignal(signal.SIGINT)),
        )
        if handler in (signal.SIG_DFL, signal.default_int_handler)
    }

    def stop(signum: int, frame: FrameType | None) -> None:
        if partial.signal is None:
            partial.signal = signum
        partial.remove()
        previous = defaults[signal.Signals(signum)]
        signal.signal(signum, previous)
        if previous is signal.SIG_DFL:
            signal.raise_signal(signum)  # ends the process here
        raise KeyboardInterrupt

    for sig in defaults:
        signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, handler in defaults.items():
            signal.signal(sig, handler)


#: ``.<target>.<pid>.<start>@<host>.<mkstemp's random part>.tmp``, as :func:`save_atomic`
#: names them: the writer named as :func:`cardcage.config.owners.owner` names a process.
_PARTIAL = re.compile(r"\..+\." + owners.OWNER + r"\.[A-Za-z0-9_]+\.tmp")


def clear_partial_files(folder: str | os.PathLike[str]) -> list[Path]:
    """Remove the partial files that killed writers on this host left in ``folder``.

    A temporary file of :func:`save_atomic` names its writer; it is removed when that
    process has ended (:func:`cardcage.config.owners.ended`: gone, or its pid now another
    process's). A live writer's file, one of another host, or a name this function did not
    make, is left alone. Returns what it removed; a folder it cannot read is skipped.
    """
    removed: list[Path] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        found = _PARTIAL.fullmatch(entry.name)
        if found is None or not owners.ended(int(found["pid"]), found["start"], found["host"]):
            continue
        with contextlib.suppress(OSError):
            os.unlink(entry.path)
            removed.append(Path(entry.path))
    return removed


class _Recorder:
    """The file object ``torch.save`` writes to: keeps the first ``OSError`` of a write,
    which torch replaces by a message of its own."""

    def __init__(self) -> None:
        self.stream: Any = None
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            written: int = self.stream.write(data)
        except OSError as error:
            self.error = self.error or error
            raise
        return written

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as error:
            self.error = self.error or error
            raise


def _os_error(error: BaseException) -> OSError | None:
    """``error`` or the first ``OSError`` it was raised from or during."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


_WRITE_ADVICE = {
    errno.ENOSPC: "free space on that disk, or write the checkpoint to another one",
    errno.EDQUOT: "free space within your disk quota, or write the checkpoint elsewhere",
    errno.EACCES: "make that folder writable for this user, or write the checkpoint elsewhere",
    errno.EPERM: "make that folder writable for this user, or write the checkpoint elsewhere",
    errno.EROFS: "that disk is mounted read-only: write the checkpoint elsewhere",
}


def write_error(target: Path, cause: OSError, *, written: bool = False) -> CheckpointError:
    """The :class:`CheckpointError` for a write of ``target`` that failed with ``cause``."""
    code = cause.errno
    reason = os.strerror(code) if code else (str(cause) or type(cause).__name__)
    reason = reason[:1].lower() + reason[1:]
    named = os.fspath(cause.filename) if isinstance(cause.filename, (str, os.PathLike)) else ""
    temporary = os.path.basename(named).startswith(f".{target.name}.")
    where = f" ({named})" if named and named != str(target) and not temporary else ""
    message = f"could not write checkpoint {target}: {reason}"
    message += f" (errno {code}){where}" if code else where
    if written:
        message += "; it was written but the rename may not have reached the disk"
    elif target.is_file():
        message += "; the previous checkpoint there is unchanged"
    else:
        message += "; nothing was written there"
    advice = _WRITE_ADVICE.get(code) if code else None
    if advice:
        message += f". Fix: {advice}"
    blocking = next((p for p in target.parents if os.path.lexists(p)), None)
    if blocking is not None and not blocking.is_dir():
        message += f". Fix: {blocking} is a file, not a folder: write the checkpoint elsewhere"
    return CheckpointError(message + ".", str(target), code)


def load(path: str | os.PathLike[str], map_location: Any = "cpu") -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_atomic`, with ``weights_only=True``.

    Inside :func:`reusing`, the file that :func:`check_resume` read (unchanged since) is not
    read again. A file that is missing, empty, truncated, not a torch file, refused by
    ``weights_only`` or not a cardcage checkpoint raises
    :class:`~cardcage.errors.MisconfigurationError` saying which.
    """
    checked = _reusable.get()
    if checked is not None and map_location == "cpu" and checked.is_file(path):
        _reusable.set(None)  # once: the caller may change what it was given
        assert checked.payload is not None
        return checked.payload
    return validation.read(path, map_location)


_reusable: ContextVar[Checked | None] = ContextVar("cardcage_checked_checkpoint", default=None)


@contextlib.contextmanager
def reusing(checked: Checked | None) -> Iterator[None]:
    """Within the block, :func:`load` of the file ``checked`` read returns what it read."""
    token = _reusable.set(checked)
    try:
        yield
    finally:
        _reusable.reset(token)
