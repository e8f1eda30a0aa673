"""Gradient accumulation on horovod all-reduces once per optimizer step: the hooks of
Horovod's DistributedOptimizer wait for ``backward_passes_per_step`` passes, and backward does
not ``synchronize`` inside ``skip_gradient_sync``. The kit's ``accumulate`` scenario checks
the weights, which an all-reduce per micro-batch would leave right too; this checks that the
gradients are still each rank's own until the last micro-batch."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from cardcage.testing.harness import Harness

JOB = Path(__file__).with_name("accumulation_job.py")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("horovod") is None,
    reason="Horovod is not installed (nox -s horovod builds it)",
)


def test_micro_batches_before_the_last_keep_each_ranks_own_gradients(tmp_path: Path) -> None:
    harness = Harness(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    try:
        harness.start([sys.executable, str(JOB), str(out)]).check()
        harness.assert_no_leftovers()
    finally:
        harness.cleanup()
    for rank in range(2):
        lines = (out / f"rank{rank}.jsonl").read_text().splitlines()
        averaged = [json.loads(line) for line in lines]
        # 8 batches per rank and epoch in steps of 3, 3 and 2: 5 later micro-batches, 2 epochs
        assert len(averaged) == 10, averaged
        assert not any(averaged), (
            f"rank {rank}: a micro-batch before the last of its step found gradients already "
            f"averaged over the ranks ({averaged}): they were all-reduced early"
        )
