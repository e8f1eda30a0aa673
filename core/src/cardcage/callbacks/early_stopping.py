"""``EarlyStopping``: stop training when a monitored metric stops improving.

Each rank judges its own value of the metric (the same on every rank when it is logged with
``sync_dist=True``, or is a validation dict) and asks to stop with ``trainer.should_stop``;
the loop agrees the request across ranks at the end of the epoch: any rank asking stops
every rank, at the same step.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

import torch

from cardcage.callbacks.base import Callback, missing_metric, validation_is_between
from cardcage.errors import MisconfigurationError

log = logging.getLogger("cardcage")

MODES = ("min", "max")


class EarlyStopping(Callback):
    """Ask the trainer to stop once ``monitor`` has not improved for ``patience`` checks.

    It checks at the end of every training epoch that validated (so this epoch's validation
    and training metrics are in ``trainer.callback_metrics``); when the fit has no
    validation, at the end of every epoch. Epochs between two validations
    (``check_val_every_n_epoch`` > 1) are not checked: the metric is not new there.

    - improvement: with ``mode="min"``, a value below ``best_score - min_delta``; with
      ``"max"``, above ``best_score + min_delta``. It resets ``wait_count`` to 0; any other
      value (NaN included) adds 1, and at ``wait_count >= patience`` the callback sets
      ``trainer.should_stop`` and ``stopped_epoch``.
    - a ``monitor`` that is not in ``trainer.callback_metrics``: with ``strict=True``, a
      :class:`~cardcage.MisconfigurationError` naming it and the available metrics;
      otherwise a warning, once, and the check is skipped.
    - ``verbose``: log each check's outcome (logger ``"cardcage"``, level INFO).
    """

    def __init__(
        self,
        monitor: str,
        min_delta: float = 0.0,
        patience: int = 3,
        mode: str = "min",
        strict: bool = True,
        verbose: bool = False,
    ):
        _check_arguments(monitor, min_delta, patience, mode, strict, verbose)
        self.monitor = monitor
        self.min_delta = float(min_delta)
        self.patience = patience
        self.mode = mode
        self.strict = strict
        self.verbose = verbose
        self.wait_count = 0
        self.stopped_epoch = 0
        self.best_score = torch.tensor(math.inf if mode == "min" else -math.inf)
        self._warned = False

    def on_train_epoch_end(self, trainer: Any, pl_module: Any, outputs: Any) -> None:
        if trainer.sanity_checking or validation_is_between(trainer):
            return
        metrics = trainer.callback_metrics
        if self.monitor not in metrics:
            message = missing_metric(type(self).__name__, self.monitor, metrics)
            if self.strict:
                raise MisconfigurationError(message)
            if not self._warned:
                self._warned = True
                warnings.warn(f"{message} The check is skipped (strict=False).", stacklevel=2)
            return
        self.check(float(metrics[self.monitor]), trainer)

    def improves(self, current: float) -> bool:
        """Whether ``current`` beats ``best_score`` by more than ``min_delta``."""
        best = float(self.best_score)
        if self.mode == "min":
            return current < best - self.min_delta
        return current > best + self.min_delta

    def check(self, current: float, trainer: Any) -> None:
        """Count one check of value ``current``; ask ``trainer`` to stop when patience is
        spent."""
        epoch = int(trainer.current_epoch)
        if self.improves(current):
            self.best_score = torch.tensor(current)
            self.wait_count = 0
            if self.verbose:
                log.info(
                    "EarlyStopping: epoch %d: %s improved to %.6g", epoch, self.monitor, current
                )
            return
        self.wait_count += 1
        if self.wait_count >= self.patience:
            self.stopped_epoch = epoch
            trainer.should_stop = True
            if self.verbose:
                log.info(
                    "EarlyStopping: epoch %d: %s did not improve on %.6g for %d checks:"
                    " asking to stop (rank %d)",
                    epoch,
                    self.monitor,
                    float(self.best_score),
                    self.wait_count,
                    int(trainer.global_rank),
                )
        elif self.verbose:
            log.info(
                "EarlyStopping: epoch %d: %s did not improve on %.6g (%d of %d)",
                epoch,
                self.monitor,
                float(self.best_score),
                self.wait_count,
                self.patience,
            )

    def on_save_checkpoint(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        return {
            "monitor": self.monitor,
            "mode": self.mode,
            "wait_count": self.wait_count,
            "stopped_epoch": self.stopped_epoch,
            "best_score": self.best_score,
            "patience": self.patience,
        }

    def on_load_checkpoint(self, state: dict[str, Any]) -> None:
        """Continue counting where the saved run stopped (``patience`` stays this
        callback's own: a resumed run may be given more)."""
        if (state.get("monitor"), state.get("mode")) != (self.monitor, self.mode):
            warnings.warn(
                f"EarlyStopping(monitor={self.monitor!r}, mode={self.mode!r}) resumes a run"
                f" that monitored {state.get('monitor')!r} (mode={state.get('mode')!r}): its"
                " count starts afresh.",
                stacklevel=2,
            )
            return
        self.wait_count = int(state["wait_count"])
        self.stopped_epoch = int(state["stopped_epoch"])
        self.best_score = torch.as_tensor(state["best_score"]).detach().cpu()


def _check_arguments(
    monitor: Any, min_delta: Any, patience: Any, mode: Any, strict: Any, verbose: Any
) -> None:
    def refuse(argument: str, value: Any, fix: str) -> MisconfigurationError:
        return MisconfigurationError(f"EarlyStopping({argument}={value!r}): {fix}")

    if not isinstance(monitor, str) or not monitor:
        raise refuse("monitor", monitor, "give the name of a logged metric, e.g. 'val_loss'.")
    if not isinstance(min_delta, int | float) or isinstance(min_delta, bool) or not min_delta >= 0:
        raise refuse(
            "min_delta",
            min_delta,
            "give a number >= 0: how much the metric must improve to count as improving.",
        )
    if not isinstance(patience, int) or isinstance(patience, bool) or patience < 0:
        raise refuse("patience", patience, "give an int >= 0: how many checks without improvement.")
    if mode not in MODES:
        raise refuse(
            "mode",
            mode,
            "mode is 'min' (lower is better, a loss) or 'max' (higher is better, an accuracy);"
            " Lightning's 'auto' is not supported.",
        )
    if not isinstance(strict, bool):
        raise refuse("strict", strict, "give True or False.")
    if not isinstance(verbose, bool):
        raise refuse("verbose", verbose, "give True or False.")
