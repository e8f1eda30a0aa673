"""Run by test_tpu_units.py in a fresh process (``xmp.spawn`` needs one that has not used XLA).

``python xla_launch_settings.py OUT`` trains ``Trainer(tpu_cores=8)`` for one step twice on
XLA's CPU device: first with ``PJRT_CPU_ASYNC_CLIENT`` unset and two devices, then with the
user's ``PJRT_CPU_ASYNC_CLIENT=1`` and one device (the asynchronous client dead-locks
all-reduces between replica threads, so it gets a single replica). Each replica writes the
value it saw to ``OUT/<run>-replica-<rank>.json``; ``OUT/after.json`` holds the value this
process has once the launcher's ``start_workers`` returns (watched, not replaced: the trainer
restores the whole environment after fit too, which would hide a launcher that does not) and
once fit returns.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from cardcage_tpu import XmpLauncher
from torch.utils.data import DataLoader
from xla_jobs import BATCH, Net, dataset

from cardcage import Trainer

VARIABLE = "PJRT_CPU_ASYNC_CLIENT"


class Recorder(Net):
    """Records ``PJRT_CPU_ASYNC_CLIENT`` as its replica's process has it, at the first step."""

    def __init__(self, out: Path, run: str) -> None:
        super().__init__()
        self.out, self.run = str(out), run

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        import torch_xla.runtime as xr

        if self.steps == 0:
            seen = Path(self.out) / f"{self.run}-replica-{xr.global_ordinal()}.json"
            seen.write_text(json.dumps(os.environ.get(VARIABLE)))
        return super().training_step(batch, batch_idx)


def fit(out: Path, run: str) -> str | None:
    Trainer(tpu_cores=8, max_steps=1).fit(
        Recorder(out, run), DataLoader(dataset(), batch_size=BATCH)
    )
    return os.environ.get(VARIABLE)


def watch_launcher(after: dict[str, str | None]) -> None:
    """Record the variable as the real ``XmpLauncher.start_workers`` leaves it."""
    start_workers = XmpLauncher.start_workers

    def watched(self: XmpLauncher, payload: bytes, folder: Path) -> None:
        start_workers(self, payload, folder)
        after[f"launch-{len(after)}"] = os.environ.get(VARIABLE)

    XmpLauncher.start_workers = watched  # type: ignore[method-assign]


def main() -> None:
    out = Path(sys.argv[1])
    launched: dict[str, str | None] = {}
    watch_launcher(launched)
    os.environ.pop(VARIABLE, None)
    os.environ["CPU_NUM_DEVICES"] = "2"
    after = {"unset": fit(out, "unset")}
    os.environ[VARIABLE] = "1"
    os.environ["CPU_NUM_DEVICES"] = "1"
    after["user"] = fit(out, "user")
    (out / "after.json").write_text(json.dumps({**after, **launched}))
    os._exit(0)  # leave at once: XLA's runtime threads need not wind down


if __name__ == "__main__":
    main()
