"""Faults in the training loop of a two-process ``ddp_spawn`` job (gloo, CPU).

- A NaN loss on rank 1. With ``terminate_on_nan=True`` that rank raises
  ``NonFiniteLossError`` at the step itself and the supervisor takes the job down: the
  launching process fails within 30 s with a ``RankFailedError`` naming rank 1 and carrying
  its traceback, which names the step; no process is left. With the default (``False``) the
  job trains to the end and rank 1 warns once, naming the step where its loss turned NaN.
- A loader with one batch whose shards hold none (12 samples, ``batch_size=8``,
  ``drop_last=True``, 6 samples a rank): each rank warns that no training step ran, naming
  its rank; with ``max_steps`` the job fails naming ``train_dataloader`` and ``max_steps``
  (instead of training nothing, or spinning through empty epochs for ever).

The scenarios run concurrently (see ``conftest.py``); each test reports one of them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

FAULT_DEADLINE = 30.0
SCRIPT = Path(__file__).parent / "scripts" / "loop_faults_job.py"
#: Rank 1's third training_step (global_step=2, batch_idx=2 of epoch 0) returns a NaN loss.
NAN_AT_STEP_3 = ("--nan-rank", "1", "--nan-step", "3")
WHERE = "global_step=2 (epoch 0, batch_idx=2) on rank 1"
EMPTY_SHARDS = ("--samples", "12", "--batch-size", "8", "--drop-last")


def start(harness: Any, *args: str) -> Any:
    out = harness.root / "out"
    command = [sys.executable, str(SCRIPT), "--out", str(out), "--marker", harness.marker, *args]
    return harness.start(command, name=f"loop_faults_job.py {' '.join(args)}")


def result(harness: Any) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((harness.root / "out" / "result.json").read_text())
    return data


def failed(harness: Any, run: Any) -> str:
    """The launcher's stderr, once it failed; no process is left and fit did not return."""
    code = run.wait(timeout=FAULT_DEADLINE + 150)  # start-up of two processes on a busy host
    assert code != 0, f"the launcher exited 0\n{run.stderr}"
    assert not (harness.root / "out" / "result.json").exists()
    harness.assert_no_leftovers()
    stderr: str = run.stderr
    return stderr


def nan_terminates(harness: Any) -> None:
    stderr = failed(harness, start(harness, *NAN_AT_STEP_3, "--terminate-on-nan"))
    assert "RankFailedError: rank 1 exited with status 1" in stderr, stderr
    report = stderr[stderr.index("RankFailedError: rank 1") :]
    assert "--- traceback of rank 1 ---" in report, stderr
    assert "NonFiniteLossError: training_step returned a loss of nan at " + WHERE in report, stderr
    assert "terminate_on_nan=True stopped training there" in report, stderr


def nan_warns(harness: Any) -> None:
    run = start(harness, *NAN_AT_STEP_3).check()
    lines = [line for line in run.stderr.splitlines() if "RuntimeWarning: cardcage:" in line]
    rank1 = [line for line in lines if "on rank 1" in line]
    assert len(rank1) == 1, run.stderr  # once per fit, though every later loss is NaN too
    assert "training_step returned a loss of nan at " + WHERE in rank1[0], run.stderr
    assert "terminate_on_nan=False" in rank1[0], run.stderr
    # The NaN gradient was averaged into rank 0's weights: rank 0 warns (once) at a later step.
    assert len(lines) <= 2, run.stderr
    assert result(harness)["global_step"] == 8  # 2 epochs of 4 steps a rank: training went on
    harness.assert_no_leftovers()


def empty_shards_warn(harness: Any) -> None:
    run = start(harness, *EMPTY_SHARDS).check()
    for rank in (0, 1):
        said = f"train_dataloader yielded no batch in epoch 0 on rank {rank} of 2"
        lines = [line for line in run.stderr.splitlines() if said in line]
        assert len(lines) == 1, run.stderr  # once per fit, not once per epoch
        assert "(its length there is 0): no training step ran" in lines[0], run.stderr
        assert "at least 2 x batch_size samples, or drop_last=False" in lines[0], run.stderr
    assert result(harness)["global_step"] == 0
    harness.assert_no_leftovers()


def empty_shards_with_max_steps_fail(harness: Any) -> None:
    stderr = failed(harness, start(harness, *EMPTY_SHARDS, "--max-steps", "5"))
    assert "RankFailedError: rank " in stderr, stderr
    assert "MisconfigurationError: train_dataloader yielded no batch in epoch 0 on rank" in stderr
    assert "but max_steps=5 asks for 5 more training steps" in stderr, stderr


SCENARIOS = {
    "nan-terminate": nan_terminates,
    "nan-warn": nan_warns,
    "empty-shards": empty_shards_warn,
    "empty-shards-max-steps": empty_shards_with_max_steps_fail,
}


@pytest.mark.parametrize("scenario", ["nan-terminate"])
def test_terminate_on_nan_takes_the_job_down_naming_rank_and_step(
    scenarios: Any, scenario: str
) -> None:
    scenarios.result(scenario)


@pytest.mark.parametrize("scenario", ["nan-warn"])
def test_a_nan_loss_on_one_rank_warns_once_naming_the_step(scenarios: Any, scenario: str) -> None:
    scenarios.result(scenario)


@pytest.mark.parametrize("scenario", ["empty-shards", "empty-shards-max-steps"])
def test_a_rank_whose_shard_yields_no_batch_says_so(scenarios: Any, scenario: str) -> None:
    scenarios.result(scenario)
