"""The CSV logger: ``metrics.csv`` and ``hparams.yaml``, and every row kept in memory.

The file has one row per step, a ``step`` column first, then the metrics in the order they
were first logged; a cell is empty where a metric was not logged at that step. A new metric
rewrites the file with the wider header (as Lightning 1.0's ``ExperimentWriter`` rewrote it);
otherwise a row is appended, and metrics logged again at the step of the last row (validation
at the end of an epoch) are merged into that row unless they would overwrite one of its
values (a test after fit at the last step, whose epoch is the next: a row of its own). The
file is current after every call: no buffer waits for :meth:`CSVLogger.save`.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import os
import warnings
from collections.abc import Mapping
from typing import Any

from cardcage.config.files import write_all, write_atomically, write_error
from cardcage.loggers.base import FolderLogger, metric_value, plain_attributes
from cardcage.loggers.hparams import write_hparams

METRICS_FILE = "metrics.csv"


class ExperimentWriter:
    """The rows and hyperparameters of one CSV run, and the files they are written to.

    ``metrics`` is the list of rows (dicts with ``"step"`` and the metrics logged at it),
    ``hparams`` the hyperparameters; both are in memory whether or not the files exist.
    Holds no open file: it pickles as its data.
    """

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.metrics: list[dict[str, Any]] = []
        self.hparams: dict[str, Any] = {}
        self.columns: list[str] = ["step"]
        self._written_columns: list[str] = []  # the header of the file on disk
        self._last_row_at = 0  # where the file's last row starts, in bytes

    @property
    def metrics_file_path(self) -> str:
        return os.path.join(self.log_dir, METRICS_FILE)

    def log_hparams(self, params: Mapping[str, Any] | argparse.Namespace) -> None:
        """Add ``params`` to the hyperparameters and rewrite ``hparams.yaml``."""
        self.hparams.update(vars(params) if isinstance(params, argparse.Namespace) else params)
        write_hparams(self.log_dir, self.hparams)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Add the row of ``step`` (or merge into the last row, when it has that step) and
        bring the file up to date."""
        values = {str(key): metric_value(value) for key, value in metrics.items()}
        merged = bool(self.metrics) and _joins(self.metrics[-1], step, values)
        if merged:
            self.metrics[-1].update(values)
        else:
            self.metrics.append({"step": step, **values})
        self.columns.extend(key for key in values if key not in self.columns)
        if self.columns != self._written_columns:
            self._rewrite()
        else:
            self._write_last_row(replace=merged)

    def _line(self, rows: list[dict[str, Any]], header: bool = False) -> bytes:
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=self.columns, lineterminator="\n")
        if header:
            writer.writeheader()
        writer.writerows(rows)
        return text.getvalue().encode("utf-8")

    def _rewrite(self) -> None:
        if not self._written_columns and os.path.exists(self.metrics_file_path):
            warnings.warn(
                f"CSVLogger: {self.metrics_file_path} exists and is replaced by this run's "
                "metrics. Give each run its own version (version=None takes the next free one).",
                UserWarning,
                stacklevel=4,
            )
        os.makedirs(self.log_dir, exist_ok=True)
        head = self._line(self.metrics[:-1], header=True)
        write_atomically(self.metrics_file_path, head + self._line(self.metrics[-1:]))
        self._written_columns = list(self.columns)
        self._last_row_at = len(head)

    def _write_last_row(self, replace: bool) -> None:
        line = self._line(self.metrics[-1:])
        path = self.metrics_file_path
        try:
            handle = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as error:
            raise write_error(path, error) from error
        try:
            at = self._last_row_at if replace else os.lseek(handle, 0, os.SEEK_END)
            try:
                os.ftruncate(handle, at)
                write_all(handle, line, at)
            except OSError as error:
                # a full disk: the row written in part is cut off, the rows before it stay
                with contextlib.suppress(OSError):
                    os.ftruncate(handle, at)
                raise write_error(path, error) from error
            self._last_row_at = at
        finally:
            os.close(handle)


def _joins(row: Mapping[str, Any], step: int, values: Mapping[str, Any]) -> bool:
    """Whether ``values`` at ``step`` merge into ``row``: the same step, and nothing in
    ``row`` they would overwrite (the epoch they share aside). A test after fit, or a
    second validation at the same step, is a row of its own."""
    if row["step"] != step:
        return False
    return all(
        key not in row or (key == "epoch" and row[key] == value) for key, value in values.items()
    )


class CSVLogger(FolderLogger):
    """Metrics to ``<save_dir>/<name>/version_<n>/metrics.csv`` and hyperparameters to
    ``hparams.yaml`` beside it (Lightning 1.0's ``CSVLogger``, with ``name="logs"``).

    ``version=None`` takes the next free ``version_<n>`` (0, 1, ...) when it is first needed;
    an ``int`` is ``version_<int>``, a string the folder's own name. Nothing is written before
    the first :meth:`log_metrics` or :meth:`log_hyperparams`. The rows stay in memory:
    :attr:`metrics` (also ``logger.experiment.metrics``) is the list of rows, each a dict with
    ``"step"`` and the metrics logged at that step, and :attr:`hparams` the hyperparameters.

    ``Trainer(logger=True)`` with ``default_root_dir`` set is
    ``CSVLogger(default_root_dir, name="logs")``; ``Trainer(logger="csv")`` the same.
    """

    logger_name = "csv"

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        name: str | None = "logs",
        version: int | str | None = None,
    ):
        super().__init__(save_dir, name, version)
        self._experiment: ExperimentWriter | None = None

    @property
    def experiment(self) -> ExperimentWriter:
        """The :class:`ExperimentWriter` holding the rows (it picks the version)."""
        if self._experiment is None:
            self._experiment = ExperimentWriter(self.log_dir)
        return self._experiment

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """Every row logged so far, in order: ``{"step": step, name: value, ...}``."""
        return self.experiment.metrics

    @property
    def hparams(self) -> dict[str, Any]:
        """The hyperparameters logged so far."""
        return self.experiment.hparams

    def _writer(self) -> ExperimentWriter:
        """The writer, into this run's folder, made (its version claimed) first."""
        log_dir = self.make_log_dir()
        experiment = self.experiment
        experiment.log_dir = log_dir  # the version claimed may be another than the one read
        return experiment

    def run_state(self) -> dict[str, Any] | None:
        state = plain_attributes(self)
        if self._experiment is not None:  # the rows, and where the file's last row starts
            state["writer"] = plain_attributes(self._experiment)
        return state

    def continue_run(self, state: dict[str, Any]) -> None:
        state = dict(state)
        writer = state.pop("writer", None)
        super().continue_run(state)
        if writer is not None:
            self.experiment.__dict__.update(writer)

    def log_hyperparams(self, params: Mapping[str, Any] | argparse.Namespace) -> None:
        self._writer().log_hparams(params)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        self._writer().log_metrics(metrics, step)
