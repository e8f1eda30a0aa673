"""A user's own loop on horovod through ``cardcage.Cage`` (own_loop_job.py, two workers from
Horovod's runner): 2 processes of batch 8 train like one process of batch 16 with momentum
SGD (the Cage leaves the user's learning rates as they are, and gives every rank rank 0's
weights), ``no_backward_sync`` holds the all-reduce back until the next backward outside it
(or the step, when no backward outside comes first), and two modules set up one after the
other, each with its optimizer, train together."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from cardcage.testing.harness import Harness

JOB = Path(__file__).with_name("own_loop_job.py")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("horovod") is None,
    reason="Horovod is not installed (nox -s horovod builds it)",
)


def largest_difference(got: list[list[float]], want: list[list[float]]) -> float:
    pairs = zip(got, want, strict=True)
    return max(abs(a - b) for g, w in pairs for a, b in zip(g, w, strict=True))


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp_path = tmp_path_factory.mktemp("own_loop")
    harness = Harness(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    try:
        harness.start([sys.executable, str(JOB), str(out)]).check()
        harness.assert_no_leftovers()
    finally:
        harness.cleanup()
    return {
        "returned": json.loads((out / "returned.json").read_text()),
        "plain": json.loads((out / "plain.json").read_text()),
        "ranks": [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)],
    }


@pytest.mark.parametrize("scenario", ["parity", "accumulate", "held_step", "two"])
def test_two_processes_of_batch_8_train_like_one_of_batch_16(
    job: dict[str, Any], scenario: str
) -> None:
    difference = largest_difference(job["returned"][scenario], job["plain"][scenario])
    assert difference < 1e-5, f"{scenario}: rank 0's weights differ by {difference}"


def test_the_cage_keeps_the_users_learning_rate(job: dict[str, Any]) -> None:
    # The Trainer multiplies it by the world size (CARDCAGE_HOROVOD_SCALE_LR's default).
    assert [rank["lr"] for rank in job["ranks"]] == [[0.1], [0.1]]


def test_no_backward_sync_all_reduces_only_at_the_next_backward_outside(
    job: dict[str, Any],
) -> None:
    for rank, seen in enumerate(job["ranks"]):
        assert seen["world_size"] == 2
        # after each micro-batch: inside no_backward_sync (own gradients), then outside
        assert seen["averaged"] == [False, True] * 8, (
            f"rank {rank}: gradients averaged over the ranks after each backward: "
            f"{seen['averaged']} (an early all-reduce shows as True at an even position)"
        )
