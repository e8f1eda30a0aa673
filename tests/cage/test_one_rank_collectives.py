"""A Cage collective that only some ranks call is named within seconds, by its method.

``if cage.global_rank == 0: cage.barrier()`` leaves rank 0 waiting for a rank that will
never come. Without the collective slot of the watcher's file (each rank marks which Cage
collective it is in), the job failed only after ``CARDCAGE_TIMEOUT``, as "rank 0 is stuck":
the rank that did call it. Here (``CARDCAGE_TIMEOUT=60``, so that a broken watcher still ends
the job) rank 0 alone calls ``cage.barrier()``, ``cage.all_reduce()``, ``cage.all_gather()``,
``cage.broadcast()`` or ``cage.save()`` while rank 1 returns from the function: within 30 s of
the call the job fails with a ``RankFailedError`` naming rank 1 as the rank that did not call
it and rank 0 as the one that did, under ddp_spawn and under script relaunch (there rank 0 is
the launching process itself; once rank 1, a relaunched child, is the lone caller). A rank
that comes 6 s late to the same collective is no such case: the job succeeds. No process is
left behind.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from cage_helpers import launch_values, outputs, start

from cardcage.testing.harness import Harness

pytestmark = pytest.mark.slow

MODES = {
    "spawn": ["--backend", "ddp_spawn", "--num-processes", "2"],
    "relaunch": ["--backend", "ddp", "--num-processes", "2"],
}
#: CARDCAGE_TIMEOUT is what a broken watcher waits for: short enough to see it fail.
ENV = {"CARDCAGE_TIMEOUT": "60", "CARDCAGE_STUCK_WARN": "30"}
#: From the lone call to the end of the job.
ENDED_WITHIN_S = 30.0
#: How late the other rank comes to a collective that every rank calls.
LATE_S = 6.0


def lone(mode: str, collective: str, rank: int = 0, late_s: float = 0.0) -> Any:
    """Rank ``rank`` alone calls ``cage.<collective>`` (every rank, the others ``late_s``
    later, when it is given)."""

    def scenario(harness: Harness) -> dict[str, Any]:
        args = ["--job", "lone", "--collective", collective, "--lone-rank", str(rank)]
        if late_s:
            args += ["--late-s", str(late_s)]
        run, out = start(harness, *MODES[mode], *args, env=ENV)
        code = run.wait(timeout=240)
        ended = time.time()
        harness.assert_no_leftovers()
        found = outputs(out)
        called = found.get(f"lone-rank{rank}", {}).get("time")
        return {
            "code": code,
            "took": None if called is None else ended - called,
            "found": found,
            "output": run.output(),
        }

    return scenario


SCENARIOS = {
    "barrier-spawn": lone("spawn", "barrier"),
    "all_reduce-spawn": lone("spawn", "all_reduce"),
    "all_gather-spawn": lone("spawn", "all_gather"),
    "broadcast-spawn": lone("spawn", "broadcast"),
    "save-spawn": lone("spawn", "save"),
    "barrier-relaunch": lone("relaunch", "barrier"),
    "all_reduce-relaunch-child": lone("relaunch", "all_reduce", rank=1),
    "late-barrier-spawn": lone("spawn", "barrier", late_s=LATE_S),
    "late-all_reduce-spawn": lone("spawn", "all_reduce", late_s=LATE_S),
}


@pytest.mark.parametrize(
    "scenario",
    [
        "barrier-spawn",
        "all_reduce-spawn",
        "all_gather-spawn",
        "broadcast-spawn",
        "save-spawn",
        "barrier-relaunch",
        "all_reduce-relaunch-child",
    ],
)
def test_a_collective_one_rank_calls_alone_is_named_within_seconds(
    scenarios: Any, scenario: str
) -> None:
    result = scenarios.result(scenario)
    name = scenario.split("-")[0]
    caller = 1 if scenario.endswith("-child") else 0
    other = 1 - caller
    assert result["code"] == 3, result["output"]  # the script's launch raised
    assert result["took"] is not None, f"rank {caller} never made the call\n{result['output']}"
    assert result["took"] <= ENDED_WITHIN_S, f"ended {result['took']:.1f}s after the call"
    (error,) = [data for key, data in result["found"].items() if key.startswith("error-")]
    assert error["type"] == "RankFailedError", error
    message = error["message"]
    assert message.startswith(f"rank {other} did not call cage.{name}()"), message
    assert f"rank {caller} called it" in message, message
    assert f"rank {other} has returned from the function" in message, message
    assert "is stuck" not in message, message
    assert not launch_values(result["found"])


@pytest.mark.parametrize("scenario", ["late-barrier-spawn", "late-all_reduce-spawn"])
def test_a_rank_that_comes_late_to_a_collective_is_waited_for(
    scenarios: Any, scenario: str
) -> None:
    result = scenarios.result(scenario)
    assert result["code"] == 0, result["output"]
    (value,) = launch_values(result["found"])
    assert value["value"] == {"rank": 0}
    assert result["took"] is not None and result["took"] >= LATE_S, result["output"]
