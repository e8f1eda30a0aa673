"""The progress bar of rank 0: steps, loss and samples per second, through tqdm.

The bar costs one ``tqdm.update`` a step; a loss is read (``.item()``, a device sync on
GPU) only when tqdm redraws, at most ten times a second, and then the previous step's.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch


class ProgressBar:
    """One bar per epoch; does nothing at all when disabled."""

    def __init__(self, enabled: bool, file: Any = None):
        self.enabled = enabled
        self.file = file
        self._bar: Any = None
        self._samples = 0
        self._start = 0.0
        self._loss: torch.Tensor | None = None

    @staticmethod
    def wanted(flag: bool | None, global_rank: int) -> bool:
        """On for rank 0 when stderr is a terminal, unless the flag says otherwise."""
        if global_rank != 0:
            return False
        if flag is not None:
            return flag
        return sys.stderr.isatty()

    def start_epoch(self, epoch: int, total: int | None) -> None:
        if not self.enabled:
            return
        from tqdm.auto import tqdm

        self._bar = tqdm(
            total=total,
            desc=f"epoch {epoch}",
            unit="step",
            file=self.file,
            dynamic_ncols=True,
            leave=True,
            mininterval=0.1,
        )
        self._samples = 0
        self._start = time.perf_counter()
        self._loss = None

    def step(self, loss: torch.Tensor, batch_size: int) -> None:
        bar = self._bar
        if bar is None:
            return
        self._samples += batch_size
        # References, no sync; the last is shown when the epoch ends. A redraw shows the
        # step before's loss: a lazy engine (XLA) has run that one already, and reading this
        # step's would run a program outside its step barrier.
        before, self._loss = self._loss, loss
        # tqdm redraws when update() returns True; read the loss only then.
        if bar.update(1) and before is not None:
            elapsed = time.perf_counter() - self._start
            bar.set_postfix(
                loss=f"{float(before.detach()):.4g}",
                samples_s=f"{self._samples / max(elapsed, 1e-9):.0f}",
                refresh=False,
            )

    def end_epoch(self, metrics: dict[str, float] | None = None) -> None:
        if self._bar is None:
            return
        # A short epoch may never redraw during its steps: show the last loss (and the
        # validation metrics) in the bar's final line.
        postfix: dict[str, str] = {}
        if self._loss is not None:
            elapsed = time.perf_counter() - self._start
            postfix["loss"] = f"{float(self._loss.detach()):.4g}"
            postfix["samples_s"] = f"{self._samples / max(elapsed, 1e-9):.0f}"
        postfix.update({k: f"{v:.4g}" for k, v in (metrics or {}).items()})
        if postfix:
            self._bar.set_postfix(postfix, refresh=False)
        self._loss = None
        self._bar.close()
        self._bar = None
