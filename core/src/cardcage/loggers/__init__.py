"""Loggers: where the Trainer writes metrics and hyperparameters (``Trainer(logger=...)``).

:class:`Logger` is the base class (Lightning 1.0's ``LightningLoggerBase``);
:class:`CSVLogger` and :class:`TensorBoardLogger` ship with the core, and a plugin adds
loggers through the ``cardcage_loggers`` hook. :func:`resolve` turns the ``logger`` flag into
a logger, :func:`check` refuses what it would refuse without building anything. The loop
calls a logger's writing methods on global rank 0 only, and a logger writes nothing before
its first write.
"""

from __future__ import annotations

from cardcage.loggers.base import DummyLogger, Logger, LoggerCollection
from cardcage.loggers.csv_logs import CSVLogger
from cardcage.loggers.flag import LoggerRegistry, check, resolve
from cardcage.loggers.tensorboard import TensorBoardLogger

#: The loggers every registry holds by name (``logger="csv"``, ``logger="tensorboard"``);
#: a plugin cannot take their names.
BUILTIN_LOGGERS: tuple[type[Logger], ...] = (CSVLogger, TensorBoardLogger)

__all__ = [
    "BUILTIN_LOGGERS",
    "CSVLogger",
    "DummyLogger",
    "Logger",
    "LoggerCollection",
    "LoggerRegistry",
    "TensorBoardLogger",
    "check",
    "resolve",
]
