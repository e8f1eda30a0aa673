"""The progress bar of rank 0: steps, loss and samples per second, through tqdm.

The loop calls :meth:`ProgressBar.step` only when tqdm would look at its clock: tqdm itself
skips every ``update`` until ``miniters`` steps have passed since it last redrew, and
``step`` tells the loop how many steps that is, so between redraws the bar costs the loop
one integer test a step, not two Python calls. A loss is read (``.item()``, a device sync
on GPU) only when tqdm redraws, at most ten times a second, and then one the loop kept at
an earlier call; so is the size of a batch (samples/s counts every batch of an epoch but
its last as a whole one, which a DataLoader's batches are).
"""

from __future__ import annotations

import functools
import math
import sys
import time
from typing import Any

import torch

#: What :meth:`ProgressBar.step` and :meth:`ProgressBar.start_epoch` return when no bar is
#: shown: the loop never calls again.
NEVER = sys.maxsize


def batch_size_of(batch: Any) -> int:
    """The number of samples in a batch (length of its first tensor), for samples/s."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size_of(batch[0])
    if isinstance(batch, dict) and batch:
        return batch_size_of(next(iter(batch.values())))
    return 1


@functools.cache
def _bar_class() -> Any:
    """tqdm's class (``tqdm.auto``: a notebook widget in Jupyter), without its monitor.

    tqdm starts a monitor thread with its first bar, to redraw bars whose ``update`` calls
    stopped coming; here the loop's countdown decides when the bar looks at its clock, so
    the thread would have nothing to do, and a fresh process that started it trained the
    tiny benchmark model about 2% slower. The subclass leaves the user's own bars as they are.
    """
    from tqdm.auto import tqdm

    return type("CardcageBar", (tqdm,), {"monitor_interval": 0})


class ProgressBar:
    """One bar per epoch; does nothing at all when disabled."""

    def __init__(self, enabled: bool, file: Any = None):
        self.enabled = enabled
        self.file = file
        self._bar: Any = None
        self._start = 0.0
        self._loss: Any = None  # the last step's loss as the loop keeps it (a float on the CPU)
        self._batch: Any = None  # the last step's batch, for its size
        self._full = 0  # the size of the epoch's first batch (a whole one)
        # tqdm's learned ``miniters`` (steps per redraw interval), carried to the next
        # epoch's bar: a new bar starts at 0 and would be called every step until its
        # first redraw, a third of a 500-step epoch of the benchmark's MLP.
        self._miniters: float = 0
        #: The values ``self.log(..., prog_bar=True)`` keeps (the loop's store: a live dict).
        self.shown: dict[str, Any] = {}
        self._shown: dict[str, Any] = {}  # as they were at the call before (see step)

    @staticmethod
    def wanted(flag: bool | None, global_rank: int) -> bool:
        """On for rank 0 when stderr is a terminal, unless the flag says otherwise."""
        if global_rank != 0:
            return False
        if flag is not None:
            return flag
        return sys.stderr.isatty()

    def start_epoch(self, epoch: int, total: int | None) -> int:
        """Open the epoch's bar; return after how many steps the loop calls :meth:`step`."""
        if not self.enabled:
            return NEVER
        self._bar = _bar_class()(
            total=total,
            desc=f"epoch {epoch}",
            unit="step",
            file=self.file,
            dynamic_ncols=True,
            leave=True,
            mininterval=0.1,
        )
        self._bar.miniters = self._miniters  # still dynamic: tqdm adjusts it at each redraw
        self._start = time.perf_counter()
        self._loss = self._batch = None
        self._full = 0
        return 1

    def step(self, loss: Any, batch: Any, steps: int = 1) -> int:
        """``steps`` more steps done, the last of them with ``loss`` (as the loop keeps it: a
        float, or a detached tensor read only when the bar redraws) on ``batch``. Returns
        how many steps the loop lets pass before it calls again: the steps tqdm would skip
        without looking at its clock (its ``miniters``), at least 1. An epoch's first call
        must come at its first step (``start_epoch`` returns 1), its last after its last."""
        bar = self._bar
        if bar is None:
            return NEVER
        # References, no sync, no size computed: a redraw shows the loss kept at the call
        # before (a lazy engine (XLA) has run that step already; reading this one's would
        # run a program outside its step barrier) and counts samples from a batch's size.
        before, self._loss, self._batch = self._loss, loss, batch
        shown, self._shown = self._shown, dict(self.shown) if self.shown else self._shown
        if before is None:  # the epoch's first step: a whole batch
            self._full = batch_size_of(batch)
        # tqdm redraws when update() returns True; read the loss only then.
        if bar.update(steps) and before is not None:
            bar.set_postfix(
                loss=f"{float(before):.4g}",
                samples_s=self._rate(),
                **{k: f"{float(v):.4g}" for k, v in shown.items()},
                refresh=False,
            )
        left: float = bar.miniters - (bar.n - bar.last_print_n)
        return max(1, math.ceil(left))

    def _rate(self) -> str:
        """Samples a second so far: every batch but the last counted as a whole one."""
        last = batch_size_of(self._batch)
        steps = self._bar.n
        samples = (steps - 1) * self._full + last
        return f"{samples / max(time.perf_counter() - self._start, 1e-9):.0f}"

    def end_epoch(self, metrics: dict[str, float] | None = None) -> None:
        if self._bar is None:
            return
        # A short epoch may never redraw during its steps: show the last loss (and the
        # validation metrics) in the bar's final line.
        postfix: dict[str, str] = {}
        if self._loss is not None:
            postfix["loss"] = f"{float(self._loss):.4g}"
            postfix["samples_s"] = self._rate()
        postfix.update({k: f"{float(v):.4g}" for k, v in self.shown.items()})
        postfix.update({k: f"{v:.4g}" for k, v in (metrics or {}).items()})
        if postfix:
            self._bar.set_postfix(postfix, refresh=False)
        self._loss = self._batch = None
        self._shown = {}
        self._miniters = self._bar.miniters
        self._bar.close()
        self._bar = None
