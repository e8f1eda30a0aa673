"""The errors cardcage raises on purpose."""

from __future__ import annotations

from typing import Any


class MisconfigurationError(ValueError):
    """An invalid flag, environment variable or combination of them.

    Raised before any process, port or CUDA context exists. The message names the flag (or
    variable), the value it had, and what to set instead.
    """


class CheckpointError(OSError):
    """A checkpoint could not be written: no space left, no permission, a read-only disk.

    An ``OSError`` (``except OSError`` catches it) whose message names the checkpoint's path,
    the cause and what to do. ``path`` is that path; ``errno`` the cause's error number (None
    when the cause had none). The previous checkpoint at ``path``, if any, is left whole and
    no partial file is left beside it.
    """

    def __init__(self, message: str, path: str | None = None, errno: int | None = None):
        super().__init__(message)
        self.message = message
        self.path = path
        self.errno = errno
        self.filename = path

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:  # path and errno survive pickling
        return (type(self), (self.message, self.path, self.errno))


class PluginError(RuntimeError):
    """A backend plugin could not be loaded or registered, or two plugins claim one name.

    Raised only for conflicts, and for load failures when ``CARDCAGE_STRICT_PLUGINS=1``;
    otherwise a broken plugin is skipped and listed by ``cardcage plugins``.
    """


#: Who stops the other ranks when cardcage's launcher started them (spawn, script relaunch).
STOPPED_BY_CARDCAGE = "every other rank was stopped"


class RankFailedError(RuntimeError):
    """A process of a distributed job failed, and the job's other processes are stopped.

    ``rank`` is the first rank that failed, ``exitcode`` its exit status (negative: killed by
    that signal; None when it is not known), ``details`` its traceback when it left one, and
    ``reason`` what happened to it when its status does not say (it left the job early, it
    was stuck, it could not be started). ``what`` is the one of these the message names.
    ``stopped`` says who stops the other ranks: cardcage's launcher when it started them
    (the default), else the launcher that did (torchrun, srun).
    """

    def __init__(
        self,
        rank: int,
        exitcode: int | None,
        details: str = "",
        reason: str = "",
        stopped: str = STOPPED_BY_CARDCAGE,
    ):
        self.rank = rank
        self.exitcode = exitcode
        self.details = details
        self.reason = reason
        self.stopped = stopped
        self.what = reason or (
            f"was killed by signal {-exitcode}"
            if exitcode is not None and exitcode < 0
            else f"exited with status {exitcode}"
        )
        message = f"rank {rank} {self.what}; {stopped}."
        if details:
            message += f"\n--- traceback of rank {rank} ---\n{details.rstrip()}"
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:  # every field survives pickling
        return (
            type(self),
            (self.rank, self.exitcode, self.details, self.reason, self.stopped),
        )


class NonFiniteLossError(RuntimeError):
    """``training_step`` returned a NaN or infinite loss and ``terminate_on_nan=True``.

    Raised in the training process at that step, before its backward and optimizer step (the
    weights are those after the step before). ``global_step``, ``epoch`` and ``batch_idx``
    name the step, as ``trainer.global_step`` and the ``batch_idx`` passed to
    ``training_step`` had them; ``value`` is the loss (``nan``, ``inf`` or ``-inf``).
    """

    def __init__(self, message: str, *, global_step: int, epoch: int, batch_idx: int, value: float):
        super().__init__(message)
        self.global_step = global_step
        self.epoch = epoch
        self.batch_idx = batch_idx
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:  # keyword-only fields survive pickling
        return (
            _rebuild_non_finite,
            (self.args[0], self.global_step, self.epoch, self.batch_idx, self.value),
        )


def _rebuild_non_finite(
    message: str, global_step: int, epoch: int, batch_idx: int, value: float
) -> NonFiniteLossError:
    return NonFiniteLossError(
        message, global_step=global_step, epoch=epoch, batch_idx=batch_idx, value=value
    )
