"""A rank that keeps the others waiting is named, with its pid and stack, and fails the job.

With ``CARDCAGE_STUCK_WARN=5 CARDCAGE_TIMEOUT=30``, a rank spinning at its third step: within
20 s stderr names it as the rank the others wait for and shows its stack inside
``training_step``; within 60 s the job exits non-zero with a ``RankFailedError`` naming that
rank (not the one that waited); no process is left. Script relaunch (the spinning rank a
child, and the launching process itself) and spawned workers.

The same holds before the loop and whatever the stuck rank does (shorter settings, 2 and 10
s): a rank sleeping in ``configure_optimizers`` shows that stack under its real pid, and a
rank stopped with SIGSTOP (which answers no request for its stack) is named as stopped, in
its setup (its peer waits in the first collective, before anyone stepped) or mid-training,
every time: the job ends on the watcher's verdict, before the process group's own timeout
(``CARDCAGE_TIMEOUT`` + 30 s) could blame the rank that waited.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

pytestmark = pytest.mark.slow

ENV = {"CARDCAGE_STUCK_WARN": "5", "CARDCAGE_TIMEOUT": "30"}
SHORT = {"CARDCAGE_STUCK_WARN": "2", "CARDCAGE_TIMEOUT": "10"}
MODES = {
    "relaunch": ["--backend", "ddp", "--num-processes", "2"],
    "spawn": ["--backend", "ddp_spawn", "--num-processes", "2"],
}
#: From the moment the rank starts spinning: named with its stack, then the job ended.
NAMED_WITHIN_S = 20.0
ENDED_WITHIN_S = 60.0
#: With SHORT: the process group would give up 40 s after the survivor began to wait.
SHORT_ENDED_WITHIN_S = 30.0


def stuck(
    mode: str,
    rank: int,
    args: list[str],
    flag: str,
    shown: list[str],
    env: dict[str, str],
    ended_within: float,
    state: str = "",
) -> Any:
    """Start the job with ``args``; once rank ``rank`` wrote ``flag`` (its pid), it must be
    named (as in ``state``) as the one the other rank waits for, with its pid and ``shown``
    in what follows, and end the job, within ``ended_within`` seconds, as stuck."""

    def scenario(harness: Any) -> None:
        out = harness.root / "out"
        run = harness.python_job(
            out, *MODES[mode], "--samples", "400", *args, env=harness.env(**env)
        )
        written = out / f"{flag}-rank{rank}"
        harness.wait_for_files([written], run)
        since = time.monotonic()
        content = written.read_text()
        pid = content if content.isdigit() else ""  # the spinning flag holds a time
        named = f"rank {rank} {state}has kept rank {1 - rank} waiting"
        header = f"--- stack of rank {rank} (pid {pid}"
        while time.monotonic() - since < NAMED_WITHIN_S and run.popen.poll() is None:
            if all(text in run.stderr.partition(named)[2] for text in [header, *shown]):
                break
            time.sleep(0.2)
        stderr = run.stderr
        assert named in stderr, f"not named within {NAMED_WITHIN_S}s\n{run.output()}"
        after = stderr.partition(named)[2]
        assert header in after, run.output()
        for text in shown:
            assert text in after, run.output()
        code = run.wait(timeout=ended_within + 30)
        took = time.monotonic() - since
        assert code != 0, run.output()
        assert took <= ended_within, f"ended after {took:.1f}s\n{run.output()}"
        assert f"RankFailedError: rank {rank} is stuck" in run.stderr, run.output()
        assert f"RankFailedError: rank {1 - rank}" not in run.stderr, run.output()
        harness.assert_no_leftovers()

    return scenario


def spinning(mode: str, rank: int) -> Any:
    """A rank spinning inside its third training step."""
    return stuck(
        mode,
        rank,
        ["--spin-rank", str(rank), "--spin-step", "3"],
        "spinning",
        ["in training_step", "in _spin"],
        ENV,
        ENDED_WITHIN_S,
    )


def spinning_short_timeout(mode: str) -> Any:
    """Only ``CARDCAGE_TIMEOUT=15`` set: the warning defaults to half of it, so the spinning
    rank is still named before the job fails (a 60 s default never fired)."""
    return stuck(
        mode,
        1,
        ["--spin-rank", "1", "--spin-step", "3"],
        "spinning",
        ["in training_step", "in _spin"],
        {"CARDCAGE_TIMEOUT": "15"},
        SHORT_ENDED_WITHIN_S,
    )


def slow_optimizers(mode: str) -> Any:
    """Rank 1 sleeps in ``configure_optimizers`` (its setup) while rank 0 trains on."""
    return stuck(
        mode,
        1,
        ["--slow-optimizers-rank", "1", "--slow-optimizers-s", "300"],
        "slow-optimizers",
        ["in configure_optimizers"],
        SHORT,
        SHORT_ENDED_WITHIN_S,
    )


def stopped(mode: str, step: int) -> Any:
    """Rank 1 stops itself with SIGSTOP: at ``step`` 0 in its setup, before any rank
    stepped; else inside that training step."""
    return stuck(
        mode,
        1,
        ["--stop-rank", "1", "--stop-step", str(step)],
        "stopping",
        ["it is stopped and cannot answer; `kill -CONT"],
        SHORT,
        SHORT_ENDED_WITHIN_S,
        state="is stopped (SIGSTOP) and ",
    )


SCENARIOS = {
    "relaunch-child": spinning("relaunch", 1),
    "relaunch-launcher": spinning("relaunch", 0),
    "spawn": spinning("spawn", 1),
    "short-timeout-spawn": spinning_short_timeout("spawn"),
    "configure-optimizers-relaunch": slow_optimizers("relaunch"),
    "configure-optimizers-spawn": slow_optimizers("spawn"),
    **{f"sigstop-setup-spawn-{i}": stopped("spawn", 0) for i in (1, 2, 3)},
    "sigstop-setup-relaunch": stopped("relaunch", 0),
    "sigstop-step-spawn": stopped("spawn", 3),
}


@pytest.mark.parametrize("scenario", ["relaunch-child", "relaunch-launcher", "spawn"])
def test_a_spinning_rank_is_named_with_its_stack_then_fails_the_job(
    scenarios: Any, scenario: str
) -> None:
    scenarios.result(scenario)


@pytest.mark.parametrize("scenario", ["short-timeout-spawn"])
def test_a_timeout_below_the_default_warning_still_names_the_stuck_rank(
    scenarios: Any, scenario: str
) -> None:
    scenarios.result(scenario)


@pytest.mark.parametrize(
    "scenario", ["configure-optimizers-relaunch", "configure-optimizers-spawn"]
)
def test_a_rank_stuck_in_its_setup_shows_its_stack_under_its_real_pid(
    scenarios: Any, scenario: str
) -> None:
    scenarios.result(scenario)


@pytest.mark.parametrize(
    "scenario",
    [
        "sigstop-setup-spawn-1",
        "sigstop-setup-spawn-2",
        "sigstop-setup-spawn-3",
        "sigstop-setup-relaunch",
        "sigstop-step-spawn",
    ],
)
def test_a_stopped_rank_is_named_every_time_before_the_group_times_out(
    scenarios: Any, scenario: str
) -> None:
    scenarios.result(scenario)
