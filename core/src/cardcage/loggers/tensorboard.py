"""The TensorBoard logger, through ``torch.utils.tensorboard.SummaryWriter``.

It needs the ``tensorboard`` package (``pip install 'cardcage[tensorboard]'``); without it,
constructing one is refused at once, before any process starts. The writer (and its events
file) is created at the first write, in the process that writes, and is never pickled.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import Mapping
from typing import Any

from cardcage.errors import MisconfigurationError
from cardcage.loggers.base import FolderLogger, metric_value
from cardcage.loggers.hparams import plain_data, write_hparams

INSTALL = "pip install 'cardcage[tensorboard]'"


def tensorboard_installed() -> bool:
    """Whether the ``tensorboard`` package can be imported (found without importing it)."""
    try:
        return importlib.util.find_spec("tensorboard") is not None
    except (ImportError, ValueError):
        return False


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested hyperparameters as one level, their keys joined with ``/`` (``{"opt/lr": 0.1}``),
    each value a number, a boolean or a string, as TensorBoard's hparams take them."""
    flat: dict[str, Any] = {}
    for key, value in plain_data(params).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}/"))
        elif isinstance(value, bool | int | float | str):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat


class TensorBoardLogger(FolderLogger):
    """Scalars and hyperparameters to TensorBoard event files in
    ``<save_dir>/<name>/version_<n>`` (Lightning 1.0's ``TensorBoardLogger``, with
    ``name="logs"``); ``tensorboard --logdir <save_dir>/<name>`` shows them.

    Each metric is a scalar (``add_scalar(name, value, step)``). Hyperparameters go to
    TensorBoard's HParams dashboard (the ``hparams`` summary, written into this run's own
    events file, nested keys joined with ``/``; no ``hp_metric`` is invented) and to
    ``hparams.yaml`` beside it. ``version`` as for :class:`~cardcage.loggers.CSVLogger`;
    other keyword arguments go to ``SummaryWriter``. :attr:`experiment` is the
    ``SummaryWriter``, made at the first write (or when :attr:`experiment` is first read).

    Raises :class:`~cardcage.MisconfigurationError` when ``tensorboard`` is not installed.
    """

    logger_name = "tensorboard"

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        name: str | None = "logs",
        version: int | str | None = None,
        **kwargs: Any,
    ):
        self.check_installed()
        super().__init__(save_dir, name, version)
        self._kwargs = kwargs
        self._hparams: dict[str, Any] = {}
        self._writer: Any = None

    @classmethod
    def check_installed(cls) -> None:
        if not tensorboard_installed():
            raise MisconfigurationError(
                "logger: TensorBoardLogger needs the tensorboard package, which is not "
                f"installed. Install it with {INSTALL} (or pip install tensorboard), or use "
                "the CSV logger (cardcage.loggers.CSVLogger, or logger=True with "
                "default_root_dir set)."
            )

    @property
    def experiment(self) -> Any:
        """The ``torch.utils.tensorboard.SummaryWriter`` of this run (made on first use)."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.make_log_dir(), **self._kwargs)
        return self._writer

    @property
    def hparams(self) -> dict[str, Any]:
        """The hyperparameters logged so far."""
        return self._hparams

    def log_hyperparams(self, params: Mapping[str, Any] | argparse.Namespace) -> None:
        from torch.utils.tensorboard.summary import hparams

        self._hparams.update(vars(params) if isinstance(params, argparse.Namespace) else params)
        writer = self.experiment
        experiment, start, end = hparams(flatten(self._hparams), {})  # type: ignore[no-untyped-call]
        for summary in (experiment, start, end):
            writer.file_writer.add_summary(summary)
        write_hparams(self.log_dir, self._hparams)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        writer = self.experiment
        for name, value in metrics.items():
            writer.add_scalar(name, metric_value(value), step)

    def save(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def finalize(self, status: str) -> None:
        """Flush and close the writer; a later write opens a new events file."""
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None

    def __getstate__(self) -> dict[str, Any]:
        # A SummaryWriter holds a thread and an open file: a pickled logger (sent to the
        # training processes) leaves it behind, and the copy makes its own at its first write.
        state = self.__dict__.copy()
        state["_writer"] = None
        return state
