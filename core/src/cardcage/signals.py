"""The requeue signal: how ``CARDCAGE_REQUEUE_SIGNAL`` (or a default) names a signal.

A cluster environment that can requeue its job names the signal that asks for a
checkpoint-and-requeue (:meth:`cardcage.cluster.ClusterEnvironment.requeue_signal`);
``cardcage submit`` reads the same setting. Acting on the signal is :mod:`cardcage.requeue`'s;
parsing it is :func:`cardcage.variables.parse_signal`'s (re-exported here).
"""

from __future__ import annotations

# The parser lives with every other CARDCAGE_* variable's; these names stay importable here.
from cardcage.variables import REQUEUE_OFF as REQUEUE_OFF
from cardcage.variables import REQUEUE_SIGNAL as REQUEUE_SIGNAL
from cardcage.variables import parse_signal as parse_signal
