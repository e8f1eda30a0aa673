"""Faults in the user's own loop, as for ``fit``: a failing rank is named in the caller and
stops every rank quickly; a rank that keeps the others waiting is named with its stack and
fails the job; with ``max_restarts`` the function runs again in fresh processes, knows it
through ``cage.restarts`` and resumes from its own checkpoint. No process is left."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from cage_helpers import launch_values, max_difference, outputs, plain_weights, start

from cardcage.testing.harness import Harness

pytestmark = pytest.mark.slow

SPAWN = ["--backend", "ddp_spawn", "--num-processes", "2"]
#: From the moment rank 1 raised, the job must have ended within this (start-up excluded).
FAULT_DEADLINE_S = 30.0
STUCK_ENV = {"CARDCAGE_STUCK_WARN": "2", "CARDCAGE_TIMEOUT": "8"}
#: From the moment rank 1 went to sleep: named with its stack, then the job ended.
NAMED_WITHIN_S = 20.0
ENDED_WITHIN_S = 40.0


def failing(harness: Harness) -> dict[str, Any]:
    run, out = start(harness, *SPAWN, "--job", "fail")
    code = run.wait()
    ended = time.time()
    harness.assert_no_leftovers()
    return {"code": code, "ended": ended, "found": outputs(out), "output": run.output()}


def stuck(harness: Harness) -> dict[str, Any]:
    run, out = start(harness, *SPAWN, "--job", "stuck", env=STUCK_ENV)
    flag = out / "stuck-rank1.json"
    deadline = time.monotonic() + 600
    while not flag.exists() and run.popen.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert flag.exists(), f"rank 1 never reached its second step\n{run.output()}"
    since = time.monotonic()
    named = "rank 1 has kept rank 0 waiting"
    while named not in run.stderr and run.popen.poll() is None:
        if time.monotonic() - since > NAMED_WITHIN_S:
            break
        time.sleep(0.2)
    named_after = time.monotonic() - since
    code = run.wait(timeout=ENDED_WITHIN_S + 60)
    ended_after = time.monotonic() - since
    harness.assert_no_leftovers()
    return {
        "code": code,
        "pid": json.loads(flag.read_text())["pid"],
        "named_after": named_after,
        "ended_after": ended_after,
        "stderr": run.stderr,
        "found": outputs(out),
        "output": run.output(),
    }


def restarting(backend: str) -> Any:
    def scenario(harness: Harness) -> dict[str, Any]:
        args = ["--backend", backend, "--num-processes", "2", "--max-restarts", "1"]
        run, out = start(harness, *args, "--job", "restart")
        run.check()
        harness.assert_no_leftovers()
        return {"found": outputs(out), "stderr": run.stderr}

    return scenario


SCENARIOS = {
    "fail": failing,
    "stuck": stuck,
    "restart-ddp_spawn": restarting("ddp_spawn"),
    "restart-ddp": restarting("ddp"),
}


@pytest.mark.parametrize("scenario", ["fail"])
def test_a_failing_rank_is_named_in_the_caller_quickly(scenarios: Any, scenario: str) -> None:
    result = scenarios.result(scenario)
    found = result["found"]
    assert result["code"] == 3, result["output"]  # the script's launch raised
    (error,) = [data for name, data in found.items() if name.startswith("error-")]
    assert error["type"] == "RankFailedError", error
    assert error["message"].startswith("rank 1 exited"), error["message"]
    assert "RuntimeError: rank 1 gives up at its second step" in error["message"]
    took = result["ended"] - found["raised-rank1"]["time"]
    assert took <= FAULT_DEADLINE_S, f"the job ended {took:.1f}s after rank 1 raised"
    assert not launch_values(found)


@pytest.mark.parametrize("scenario", ["stuck"])
def test_a_stuck_rank_is_named_with_its_stack(scenarios: Any, scenario: str) -> None:
    """Rank 1 sleeps inside fn before its second step while rank 0 waits in that step's
    collective: stderr names rank 1 (not the rank that waits) with its stack, then the job
    fails naming it."""
    result = scenarios.result(scenario)
    stderr = result["stderr"]
    named = "rank 1 has kept rank 0 waiting"
    assert named in stderr, result["output"]
    assert result["named_after"] <= NAMED_WITHIN_S, result["output"]
    after = stderr.partition(named)[2]
    assert f"--- stack of rank 1 (pid {result['pid']})" in after, result["output"]
    assert "in stuck_here" in after, result["output"]
    assert result["code"] == 3, result["output"]
    assert result["ended_after"] <= ENDED_WITHIN_S, result["output"]
    (error,) = [data for name, data in result["found"].items() if name.startswith("error-")]
    assert error["type"] == "RankFailedError", error
    assert error["message"].startswith("rank 1 is stuck"), error["message"]


@pytest.mark.parametrize("scenario", ["restart-ddp_spawn", "restart-ddp"])
def test_max_restarts_runs_fn_again_which_resumes_from_its_checkpoint(
    scenarios: Any, scenario: str, job: Any
) -> None:
    """Rank 1 leaves with os._exit(1) in the second epoch of the first attempt; the second
    attempt sees cage.restarts == 1 on every rank (under ddp the relaunched child too, from
    CARDCAGE_RESTARTS), loads the checkpoint of epoch 1 and ends with the weights of an
    uninterrupted run."""
    result = scenarios.result(scenario)
    found = result["found"]
    reference = plain_weights(job, job.adam, job.RESUME_EPOCHS, seed=7, shuffled=True)
    for rank in range(2):
        assert found[f"attempt0-rank{rank}"]["restarts"] == 0
        assert found[f"attempt1-rank{rank}"] == {"restarts": 1, "env": "1"}
        assert f"attempt2-rank{rank}" not in found
        final = found[f"restart-rank{rank}"]
        assert (final["restarts"], final["start"]) == (1, 1)
        assert max_difference(final["weights"], final["straight"]) <= 1e-6, rank
        assert max_difference(final["weights"], reference) <= 1e-5, rank
    assert "rank 1 left the job early" in result["stderr"]
    values = launch_values(found)
    assert len(values) == (2 if scenario == "restart-ddp" else 1), values
    for value in values:
        assert value["value"] == found["restart-rank0"]
