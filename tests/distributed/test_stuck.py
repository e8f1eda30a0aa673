"""A rank that hangs inside ``training_step`` is named, with its stack, and fails the job.

With ``CARDCAGE_STUCK_WARN=5 CARDCAGE_TIMEOUT=30``, a rank spinning at its third step: within
20 s stderr names it as the rank the others wait for and shows its stack inside
``training_step``; within 60 s the job exits non-zero with a ``RankFailedError`` naming that
rank (not the one that waited); no process is left. Script relaunch (the spinning rank a
child, and the launching process itself) and spawned workers.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

pytestmark = pytest.mark.slow

ENV = {"CARDCAGE_STUCK_WARN": "5", "CARDCAGE_TIMEOUT": "30"}
MODES = {
    "relaunch": ["--backend", "ddp", "--num-processes", "2"],
    "spawn": ["--backend", "ddp_spawn", "--num-processes", "2"],
}
#: From the moment the rank starts spinning: named with its stack, then the job ended.
NAMED_WITHIN_S = 20.0
ENDED_WITHIN_S = 60.0


def spinning(mode: str, rank: int) -> Any:
    def scenario(harness: Any) -> None:
        out = harness.root / "out"
        run = harness.python_job(
            out,
            *MODES[mode],
            "--samples",
            "400",
            "--spin-rank",
            str(rank),
            "--spin-step",
            "3",
            env=ENV,
        )
        flag = out / f"spinning-rank{rank}"
        harness.wait_for_files([flag], run)
        since = time.monotonic()
        other = 1 - rank
        named = f"rank {rank} has kept rank {other} waiting"
        while time.monotonic() - since < NAMED_WITHIN_S and run.popen.poll() is None:
            stderr = run.stderr
            if named in stderr and "in training_step" in stderr.partition(named)[2]:
                break
            time.sleep(0.2)
        stderr = run.stderr
        assert named in stderr, f"not named within {NAMED_WITHIN_S}s\n{run.output()}"
        shown = stderr.partition(named)[2]
        assert f"--- stack of rank {rank}" in shown and "in training_step" in shown, run.output()
        assert "in _spin" in shown, run.output()
        code = run.wait(timeout=ENDED_WITHIN_S + 30)
        took = time.monotonic() - since
        assert code != 0, run.output()
        assert took <= ENDED_WITHIN_S, f"ended after {took:.1f}s\n{run.output()}"
        assert f"RankFailedError: rank {rank} is stuck" in run.stderr, run.output()
        harness.assert_no_leftovers()

    return scenario


SCENARIOS = {
    "relaunch-child": spinning("relaunch", 1),
    "relaunch-launcher": spinning("relaunch", 0),
    "spawn": spinning("spawn", 1),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_spinning_rank_is_named_with_its_stack_then_fails_the_job(
    scenarios: Any, scenario: str
) -> None:
    scenarios.result(scenario)
