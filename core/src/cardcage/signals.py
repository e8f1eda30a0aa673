"""The requeue signal: how ``CARDCAGE_REQUEUE_SIGNAL`` (or a default) names a signal.

A cluster environment that can requeue its job names the signal that asks for a
checkpoint-and-requeue (:meth:`cardcage.cluster.ClusterEnvironment.requeue_signal`);
``cardcage submit`` reads the same setting. Acting on the signal is :mod:`cardcage.requeue`'s.
"""

from __future__ import annotations

import signal

from cardcage.errors import MisconfigurationError

REQUEUE_SIGNAL = "CARDCAGE_REQUEUE_SIGNAL"
REQUEUE_OFF = ("", "0", "none", "off", "no", "false")


def parse_signal(value: str, source: str = REQUEUE_SIGNAL) -> signal.Signals | None:
    """A signal named like ``USR1``, ``SIGUSR1`` or ``10``; ``None`` for ``none``/``off``/``0``."""
    text = value.strip()
    if text.lower() in REQUEUE_OFF:
        return None
    try:
        if text.isdigit():
            return signal.Signals(int(text))
        name = text.upper()
        return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    except (KeyError, ValueError):
        pass
    raise MisconfigurationError(
        f"{source}={value!r} is not a signal. Use a name such as USR1 or USR2 (the one given "
        "to sbatch --signal), a number, or none to turn checkpoint-and-requeue off."
    )
