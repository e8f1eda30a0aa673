"""Gradient accumulation on fsdp reduce-scatters once per optimizer step: the micro-batches
before the last run with ``set_requires_gradient_sync(False)`` (``skip_gradient_sync``).
The kit's ``accumulate`` scenario checks the weights, which a reduce-scatter per micro-batch
would leave right too; this checks that none ran before the last micro-batch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cardcage.testing.harness import Harness

JOB = Path(__file__).with_name("accumulation_job.py")


def test_micro_batches_before_the_last_leave_no_sharded_gradients(tmp_path: Path) -> None:
    harness = Harness(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    try:
        harness.start([sys.executable, str(JOB), str(out), "3"]).check()
        harness.assert_no_leftovers()
    finally:
        harness.cleanup()
    for rank in range(2):
        seen = json.loads((out / f"rank{rank}.json").read_text())
        # 8 batches per rank and epoch in steps of 3, 3 and 2: 5 later micro-batches, 2 epochs
        assert len(seen) == 10, seen
        assert not any(seen), (
            f"rank {rank}: a micro-batch before the last of its step found sharded gradients "
            f"({seen}): they were reduce-scattered, so gradient sync was not skipped"
        )
