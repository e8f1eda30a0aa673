"""What a logger is: Lightning 1.0's ``LightningLoggerBase``, and the folder the built-in ones
write into.

The loop calls a logger's writing methods (:meth:`Logger.log_hyperparams`,
:meth:`Logger.log_metrics`, :meth:`Logger.save`, :meth:`Logger.finalize`) on global rank 0
only. A logger is often built in the process that calls ``fit`` and pickled to the training
processes, so it must hold nothing that cannot be pickled (an open file, a writer) before its
first write, and must create nothing on disk before it: the rank-0 process writes.
"""

from __future__ import annotations

import abc
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from cardcage.config.files import write_error
from cardcage.config.flags import writable_folder


def metric_value(value: Any) -> Any:
    """A logged value as a plain number: a tensor or NumPy scalar as its ``item()``."""
    item = getattr(value, "item", None)
    return item() if callable(item) else value


class Logger(abc.ABC):
    """A logger the Trainer writes metrics and hyperparameters to (``Trainer(logger=...)``).

    Subclass it and implement :attr:`name`, :attr:`version`, :meth:`log_hyperparams` and
    :meth:`log_metrics`; :meth:`save`, :meth:`finalize`, :attr:`save_dir`, :attr:`log_dir` and
    :attr:`experiment` have defaults. A plugin registers its logger class through the
    ``cardcage_loggers`` hook under :attr:`logger_name`, and ``Trainer(logger="<logger_name>")``
    then builds it as ``cls(save_dir=default_root_dir)``: every other argument of its
    constructor needs a default.
    """

    #: The name ``Trainer(logger="...")`` selects this class by when a plugin registers it
    #: (matched without regard to case). Empty: the class cannot be registered.
    logger_name: ClassVar[str] = ""

    @classmethod
    def check_installed(cls) -> None:
        """Raise :class:`~cardcage.MisconfigurationError` when a package this logger needs is
        not installed (the message says what to install). ``Trainer(logger="<name>")`` and
        ``cardcage.select`` call it before building the logger; the default checks nothing."""
        return None  # a default, not a method left to implement

    @property
    @abc.abstractmethod
    def name(self) -> str | None:
        """The experiment's name (a folder level for the loggers that write files)."""

    @property
    @abc.abstractmethod
    def version(self) -> int | str | None:
        """The experiment's version (``version_<n>`` for the loggers that write files)."""

    @property
    def save_dir(self) -> str | None:
        """The folder the logger writes under, or ``None`` when it writes no files."""
        return None

    @property
    def log_dir(self) -> str | None:
        """The folder of this run's files, or ``None`` when it writes no files."""
        return None

    @property
    def experiment(self) -> Any:
        """The object behind the logger (a ``SummaryWriter`` for TensorBoard), for what the
        logger's methods do not cover; ``None`` when there is none."""
        return None

    def make_log_dir(self) -> str | None:
        """Make the folder of this run's files (claiming its version) and return it; the
        Trainer calls it when ``fit`` starts, in the process that is or starts global rank
        0. The default makes nothing and returns :attr:`log_dir`."""
        return self.log_dir

    @abc.abstractmethod
    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Record the run's hyperparameters (the model's ``hparams``)."""

    @abc.abstractmethod
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` (name to value) at ``step`` (the global step)."""

    def save(self) -> None:
        """Make what was logged so far durable (the built-in loggers write as they go)."""
        return None  # a default, not a method left to implement

    def finalize(self, status: str) -> None:
        """The run ended (``status``: ``"success"``, ``"failed"`` or ``"interrupted"``); save
        and release what the logger holds. Called once at the end of ``fit``, on rank 0."""
        self.save()

    def run_state(self) -> dict[str, Any] | None:
        """What another copy of this logger needs to go on with the run this one wrote, as
        plain data (numbers, strings, lists, dicts), or ``None``: workers that trained hand
        it back to the process that called ``fit`` (``ddp_spawn``), whose ``test()`` then
        adds to the fit's files instead of starting them again. The default hands nothing."""
        return None

    def continue_run(self, state: dict[str, Any]) -> None:
        """Go on with the run another copy wrote (what its :meth:`run_state` returned)."""
        return None  # a default, not a method left to implement


class LoggerCollection(Logger):
    """Several loggers as one: every call goes to each, in order (``Trainer(logger=[a, b])``).

    :attr:`name` and :attr:`version` join the loggers' own with ``_``; :attr:`save_dir` and
    :attr:`log_dir` are ``None`` (the loggers keep their own); :attr:`experiment` is the list
    of theirs. Iterating, indexing and ``len`` reach the loggers.
    """

    def __init__(self, loggers: Sequence[Logger]):
        self._loggers = list(loggers)

    def __iter__(self) -> Iterator[Logger]:
        return iter(self._loggers)

    def __getitem__(self, index: int) -> Logger:
        return self._loggers[index]

    def __len__(self) -> int:
        return len(self._loggers)

    @property
    def name(self) -> str:
        return "_".join(str(logger.name) for logger in self._loggers)

    @property
    def version(self) -> str:
        return "_".join(str(logger.version) for logger in self._loggers)

    @property
    def experiment(self) -> list[Any]:
        return [logger.experiment for logger in self._loggers]

    def make_log_dir(self) -> None:
        for logger in self._loggers:
            logger.make_log_dir()

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        for logger in self._loggers:
            logger.log_hyperparams(params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for logger in self._loggers:
            logger.log_metrics(metrics, step)

    def save(self) -> None:
        for logger in self._loggers:
            logger.save()

    def finalize(self, status: str) -> None:
        for logger in self._loggers:
            logger.finalize(status)

    def run_state(self) -> dict[str, Any] | None:
        return {"loggers": [logger.run_state() for logger in self._loggers]}

    def continue_run(self, state: dict[str, Any]) -> None:
        for logger, own in zip(self._loggers, state.get("loggers", []), strict=False):
            if own is not None:
                logger.continue_run(own)


def plain(value: Any) -> bool:
    """Whether ``value`` is plain data: what ``torch.load(weights_only=True)`` reads back."""
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, list | tuple):
        return all(plain(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(k, str | int) and plain(v) for k, v in value.items())
    return False


def plain_attributes(obj: Any) -> dict[str, Any]:
    """``obj``'s attributes whose values are plain data."""
    return {name: value for name, value in vars(obj).items() if plain(value)}


_VERSION_FOLDER = re.compile(r"version_(\d+)")


def next_version(root: str) -> int:
    """One more than the largest ``version_<n>`` folder under ``root``; 0 when there is none
    (or no ``root``). Reads the folder, creates nothing."""
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return 0
    found = [
        int(match[1])
        for entry in entries
        if entry.is_dir() and (match := _VERSION_FOLDER.fullmatch(entry.name))
    ]
    return max(found) + 1 if found else 0


class FolderLogger(Logger):
    """A logger writing files into ``<save_dir>/<name>/version_<n>`` (a ``version`` string is
    the folder's name as it is; a ``name`` of ``""`` or ``None`` drops that level).

    ``version=None`` picks the next free ``version_<n>`` when the version is first needed
    (the first write, or reading :attr:`version` or :attr:`log_dir`), by reading the folder;
    nothing is created before the first write. The first write (:meth:`make_log_dir`) claims
    the version by creating its folder: a run that finds it made by another (two runs
    started at once into one ``save_dir``) takes the next free one. A ``save_dir`` where no
    folder can be made is refused when the logger is built.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        name: str | None = "logs",
        version: int | str | None = None,
    ):
        self._save_dir = os.fspath(save_dir)
        self._name = name or ""
        self._version = version
        self._claims_version = version is None  # a version picked, not given: claimed
        self._made = False  # whether this run's folder was made (its version claimed)
        writable_folder(
            f"{type(self).__name__}(save_dir",
            self._save_dir,
            close=")",
            fix="Give a folder you can write to (it is made when missing).",
        )

    def make_log_dir(self) -> str:
        """This run's folder, made if it is not yet (what a writer calls before it writes).

        A picked version is claimed by ``mkdir`` of its folder, which only one process can
        do: when the folder exists already, the next free version is taken (a given version
        is used as it is, made or not). Raises an ``OSError`` naming the folder when it
        cannot be made."""
        if not self._made:
            try:
                if self._claims_version:
                    os.makedirs(self.root_dir, exist_ok=True)
                    version = int(self.version)
                    while True:
                        try:
                            os.mkdir(os.path.join(self.root_dir, f"version_{version}"))
                            break
                        except FileExistsError:
                            version = max(version + 1, next_version(self.root_dir))
                    self._version = version
                else:
                    os.makedirs(self.log_dir, exist_ok=True)
            except OSError as error:
                raise write_error(self.log_dir, error) from error
            self._made = True
        return self.log_dir

    @property
    def save_dir(self) -> str:
        return self._save_dir

    def run_state(self) -> dict[str, Any] | None:
        """The attributes that are plain data (the version picked, and claimed): the
        caller's copy goes on in the same folder."""
        return plain_attributes(self)

    def continue_run(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def name(self) -> str:
        return self._name

    @property
    def root_dir(self) -> str:
        """``<save_dir>/<name>``: the folder the versions are in."""
        return os.path.join(self._save_dir, self._name)

    @property
    def version(self) -> int | str:
        if self._version is None:
            self._version = next_version(self.root_dir)
        return self._version

    @property
    def log_dir(self) -> str:
        version = self.version
        folder = version if isinstance(version, str) else f"version_{version}"
        return os.path.join(self.root_dir, folder)


class _DummyExperiment:
    """What :attr:`DummyLogger.experiment` is: any method called on it does nothing."""

    def _nothing(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return self._nothing

    def __getitem__(self, index: Any) -> _DummyExperiment:
        return self


class DummyLogger(Logger):
    """What ``trainer.logger`` is on every rank but global rank 0 (Lightning's
    ``DummyLogger``): the run's :attr:`name`, :attr:`version` and folders as rank 0's logger
    has them (a callback reading ``trainer.logger.log_dir`` finds the same folder on every
    rank), while every write, and every call on :attr:`experiment` (``add_image``, ...), does
    nothing: only rank 0 writes the run's files."""

    def __init__(self, logger: Logger):
        self.logger = logger  # rank 0's logger, as this rank got it: never written to

    @property
    def name(self) -> str | None:
        return self.logger.name

    @property
    def version(self) -> int | str | None:
        return self.logger.version

    @property
    def save_dir(self) -> str | None:
        return self.logger.save_dir

    @property
    def log_dir(self) -> str | None:
        return self.logger.log_dir

    @property
    def experiment(self) -> Any:
        return _DummyExperiment()

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        return None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        return None

    def finalize(self, status: str) -> None:
        return None

    def __getitem__(self, index: int) -> DummyLogger:
        inner = self.logger
        return DummyLogger(inner[index]) if isinstance(inner, LoggerCollection) else self

    def __iter__(self) -> Iterator[Logger]:
        inner = self.logger
        loggers = list(inner) if isinstance(inner, LoggerCollection) else [inner]
        return iter([DummyLogger(logger) for logger in loggers])

    def __len__(self) -> int:
        inner = self.logger
        return len(inner) if isinstance(inner, LoggerCollection) else 1


def for_rank(logger: Logger | None, global_rank: int) -> Logger | None:
    """The logger a process of ``global_rank`` holds: ``logger`` on rank 0, a
    :class:`DummyLogger` in its place on the others."""
    if logger is None or global_rank == 0 or isinstance(logger, DummyLogger):
        return logger
    return DummyLogger(logger)
