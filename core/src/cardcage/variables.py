"""cardcage's own environment variables: each one read and checked in one place.

Every ``CARDCAGE_*`` variable a user may set is listed in :data:`VARIABLES` with what it
means; :func:`check_variables` checks all of them in the calling process before any process
starts (``Trainer`` and ``fit``), so that a bad value is a
:class:`~cardcage.errors.MisconfigurationError` naming the variable, its value and the fix,
never a failure of a training process minutes later.
"""

from __future__ import annotations

import math
import os

from cardcage.errors import MisconfigurationError

INIT_TIMEOUT = "CARDCAGE_INIT_TIMEOUT"
TIMEOUT = "CARDCAGE_TIMEOUT"
STUCK_WARN = "CARDCAGE_STUCK_WARN"

#: The variables a user sets, with what each one means (``cardcage`` checks all of them).
VARIABLES: dict[str, str] = {
    INIT_TIMEOUT: "seconds every rank may take to reach the rendezvous (default 300)",
    TIMEOUT: "seconds a rank may keep the others waiting before the job fails (default 1800)",
    STUCK_WARN: "seconds of waiting after which the rank that keeps the others waiting is "
    "named, with its stack (default 60)",
}


def seconds(name: str, default: float) -> float:
    """The positive, finite number of seconds the variable ``name`` holds (``default``
    when unset or empty)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise MisconfigurationError(
            f"environment variable {name}={raw!r} is not a positive number of seconds. "
            f"Set it to one (for example {name}={default:g}, the default), or unset it."
        )
    return value


def init_timeout() -> float:
    """Seconds every rank may take to arrive (``CARDCAGE_INIT_TIMEOUT``, default 300)."""
    return seconds(INIT_TIMEOUT, 300.0)


def job_timeout() -> float:
    """Seconds a rank may keep the others waiting before the job fails
    (``CARDCAGE_TIMEOUT``, default 1800)."""
    return seconds(TIMEOUT, 1800.0)


def stuck_warn() -> float:
    """Seconds of waiting after which the rank that keeps the others waiting is named
    (``CARDCAGE_STUCK_WARN``, default 60)."""
    return seconds(STUCK_WARN, 60.0)


def check_variables() -> None:
    """Check every ``CARDCAGE_*`` variable that is set; raise
    :class:`~cardcage.errors.MisconfigurationError` for the first bad one."""
    init_timeout()
    job_timeout()
    stuck_warn()
