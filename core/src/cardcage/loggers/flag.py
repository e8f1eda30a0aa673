"""The Trainer's ``logger`` flag: what it may hold (:func:`check`) and the logger it makes
(:func:`resolve`).

``logger`` takes Lightning 1.0's values, and a name:

- ``True``: a :class:`~cardcage.loggers.CSVLogger` writing under ``default_root_dir``
  (``<default_root_dir>/logs/version_<n>``); with ``default_root_dir=None``, under ``here``
  (the Trainer passes the current folder when ``logger=True`` was passed explicitly, as
  Lightning writes ``./lightning_logs``), else no logger: a Trainer built without a
  ``logger`` argument and without ``default_root_dir`` writes nothing.
- ``False`` or ``None``: no logger.
- a :class:`~cardcage.loggers.Logger`: that logger.
- a name (``"csv"``, ``"tensorboard"``, or one a plugin registers through the
  ``cardcage_loggers`` hook, without regard to case): that logger class, built as
  ``cls(save_dir=default_root_dir)``. A name needs ``default_root_dir`` (a named logger has
  nowhere else to write); without it the name is refused, pointing at both fixes.
- a list or tuple of loggers and names: each, as one
  :class:`~cardcage.loggers.LoggerCollection` (one item: that logger; none: no logger).

Anything else is refused with a :class:`~cardcage.MisconfigurationError` naming the flag, the
value and what to pass instead.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from typing import Protocol

from cardcage.errors import MisconfigurationError
from cardcage.loggers.base import Logger, LoggerCollection
from cardcage.loggers.csv_logs import CSVLogger

WHAT_TO_PASS = (
    "Pass True (a CSV logger under default_root_dir), False, a cardcage.loggers.Logger "
    "(CSVLogger(save_dir=...), TensorBoardLogger(save_dir=...)), a registered logger's name "
    "or a list of these."
)


class LoggerRegistry(Protocol):
    """What :func:`check` and :func:`resolve` read of the plugin registry: the logger classes
    by lower-case name (``cardcage.plugins.manager.Registry`` is one)."""

    @property
    def loggers(self) -> Mapping[str, type[Logger]]: ...


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _not_a_logger(value: object, where: str) -> MisconfigurationError:
    if isinstance(value, type) and issubclass(value, Logger):
        return MisconfigurationError(
            f"{where}{value.__name__} is a logger class, not a logger: construct it, "
            f"logger={value.__name__}(save_dir=...)."
        )
    return MisconfigurationError(
        f"{where}{_shown(value)} ({type(value).__name__}) is not a logger. {WHAT_TO_PASS}"
    )


def _check_name(
    name: str, default_root_dir: str | os.PathLike[str] | None, registry: LoggerRegistry | None
) -> None:
    if not name.strip():
        raise MisconfigurationError(f"logger={name!r} names no logger. {WHAT_TO_PASS}")
    cls: type[Logger] | None = None
    if registry is not None:
        key = name.strip().lower()
        known = sorted(registry.loggers)
        if key not in registry.loggers:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            names = ", ".join(repr(k) for k in known) or "none"
            raise MisconfigurationError(
                f"logger={name!r}: no logger of that name is registered.{hint} Known logger "
                f"names: {names} (a plugin adds more through the cardcage_loggers hook); or "
                "pass a cardcage.loggers.Logger itself."
            )
        cls = registry.loggers[key]
    if default_root_dir is None:
        built = cls.__name__ if cls is not None else "the logger"
        instance = cls.__name__ if cls is not None else "MyLogger"
        raise MisconfigurationError(
            f"logger={name!r} builds {built}(save_dir=default_root_dir), and "
            f"default_root_dir is not set. Set default_root_dir='<folder>', or pass the "
            f"logger itself: logger={instance}(save_dir='<folder>')."
        )
    if cls is not None:
        cls.check_installed()


def check(
    logger: object,
    default_root_dir: str | os.PathLike[str] | None,
    registry: LoggerRegistry | None = None,
) -> None:
    """Refuse a ``logger`` flag :func:`resolve` would refuse, building nothing.

    With ``registry``, a name must be registered (and what its class needs installed);
    without it, only the value's form is checked. Loads no plugin and touches no file, so
    ``cardcage.select`` can call it as the Trainer's constructor does.

    :raises MisconfigurationError: naming the flag, the value and what to pass instead.
    """
    if logger is None or isinstance(logger, bool | Logger):
        return
    if isinstance(logger, str):
        _check_name(logger, default_root_dir, registry)
        return
    if isinstance(logger, list | tuple):
        for index, item in enumerate(logger):
            if isinstance(item, str):
                _check_name(item, default_root_dir, registry)
            elif not isinstance(item, Logger):
                raise _not_a_logger(item, f"logger=[...]: item {index}, ")
        return
    raise _not_a_logger(logger, "logger=")


def resolve(
    logger: object,
    default_root_dir: str | os.PathLike[str] | None,
    registry: LoggerRegistry,
    here: str | os.PathLike[str] | None = None,
) -> Logger | None:
    """The logger the ``logger`` flag asks for, or ``None`` for no logger (see the module);
    ``here``: where ``True`` writes when ``default_root_dir`` is None.

    Builds the loggers it names, which write nothing until their first write.

    :raises MisconfigurationError: for what :func:`check` refuses, and when a named logger's
        constructor refuses.
    """
    check(logger, default_root_dir, registry)
    if logger is None or logger is False:
        return None
    if logger is True:
        folder = default_root_dir if default_root_dir is not None else here
        return None if folder is None else CSVLogger(folder, name="logs")
    if isinstance(logger, Logger):
        return logger
    if isinstance(logger, str):
        return _build(logger, default_root_dir, registry)
    assert isinstance(logger, list | tuple)
    loggers = [
        item if isinstance(item, Logger) else _build(item, default_root_dir, registry)
        for item in logger
    ]
    if not loggers:
        return None
    return loggers[0] if len(loggers) == 1 else LoggerCollection(loggers)


def _build(
    name: str, default_root_dir: str | os.PathLike[str] | None, registry: LoggerRegistry
) -> Logger:
    assert default_root_dir is not None  # check refused a name without it
    cls = registry.loggers[name.strip().lower()]
    return cls(save_dir=default_root_dir)  # type: ignore[call-arg]
