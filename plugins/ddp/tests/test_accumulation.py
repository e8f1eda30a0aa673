"""Gradient accumulation on ddp communicates once per optimizer step: the micro-batches
before the last run in DistributedDataParallel's ``no_sync`` (``skip_gradient_sync``). The
weights are checked against a plain loop by the kit's ``accumulate`` scenario; a backend
that all-reduced every micro-batch would pass that one too, so this counts the all-reduces."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from cardcage.testing.harness import Harness
from cardcage.testing.models import SAMPLES

JOB = Path(__file__).with_name("accumulation_job.py")
BATCH, WORLD, EPOCHS = 4, 2, 2


def test_only_the_last_micro_batch_of_each_step_all_reduces(tmp_path: Path) -> None:
    accumulate = 3
    harness = Harness(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    try:
        harness.start([sys.executable, str(JOB), str(out), str(accumulate)]).check()
        harness.assert_no_leftovers()
    finally:
        harness.cleanup()
    batches = SAMPLES // (BATCH * WORLD)  # per rank and epoch: 8, in groups of 3, 3 and 2
    steps = EPOCHS * math.ceil(batches / accumulate)
    for rank in range(WORLD):
        counts = json.loads((out / f"rank{rank}.json").read_text())
        assert counts["backwards"] == EPOCHS * batches, counts
        assert counts["synchronized"] == steps, (
            f"rank {rank}: {counts['synchronized']} backward passes all-reduced, not one per "
            f"optimizer step ({steps}) of {counts['backwards']}: no_sync was not used"
        )
