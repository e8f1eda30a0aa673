"""The errors cardcage raises on purpose."""

from __future__ import annotations


class MisconfigurationError(ValueError):
    """An invalid flag, environment variable or combination of them.

    Raised before any process, port or CUDA context exists. The message names the flag (or
    variable), the value it had, and what to set instead.
    """


class PluginError(RuntimeError):
    """A backend plugin could not be loaded or registered, or two plugins claim one name.

    Raised only for conflicts, and for load failures when ``CARDCAGE_STRICT_PLUGINS=1``;
    otherwise a broken plugin is skipped and listed by ``cardcage plugins``.
    """


class RankFailedError(RuntimeError):
    """A process of a distributed job failed; every other process of the job was stopped.

    ``rank`` is the first rank that failed, ``exitcode`` its exit status (negative: killed by
    that signal) and ``details`` its traceback when it left one.
    """

    def __init__(self, rank: int, exitcode: int | None, details: str = "", reason: str = ""):
        self.rank = rank
        self.exitcode = exitcode
        self.details = details
        what = reason or (
            f"was killed by signal {-exitcode}"
            if exitcode is not None and exitcode < 0
            else f"exited with status {exitcode}"
        )
        message = f"rank {rank} {what}; every other rank was stopped."
        if details:
            message += f"\n--- traceback of rank {rank} ---\n{details.rstrip()}"
        super().__init__(message)
