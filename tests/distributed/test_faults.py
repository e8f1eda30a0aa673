"""Faults: a rank that raises, a rank killed with SIGKILL, a rank that leaves early with
status 0, SIGTERM or SIGINT to the launcher. Each ends the job within 30 s of the fault with a
non-zero exit that names the failing rank (never a survivor that failed because it was
gone), and leaves no process behind.

The scenarios run concurrently (see ``conftest.py``); each test reports one of them.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

FAULT_DEADLINE = 30.0
#: Enough slow steps (100 per rank, 0.2 s each) that the job is still training when the
#: fault lands, however long the others take to start.
SLOW = ["--samples", "1600", "--step-sleep", "0.2"]
MODES = {
    "relaunch": ["--backend", "ddp", "--num-processes", "2"],
    "spawn": ["--backend", "ddp_spawn", "--num-processes", "2"],
}


def start(harness: Any, mode: str, *args: str) -> Any:
    out = harness.root / "out"
    if mode == "torchrun":
        return harness.torchrun_job(out, ["--nproc-per-node=2", "--standalone"], *args, *SLOW)
    return harness.python_job(out, *MODES[mode], *args, *SLOW)


def ended_within_deadline(run: Any, since: float, what: str) -> int:
    """Wait for the launcher: it must end within FAULT_DEADLINE of ``since``, and fail."""
    code: int = run.wait(timeout=FAULT_DEADLINE + 30)
    took = time.monotonic() - since
    assert took <= FAULT_DEADLINE, f"{what}: the job took {took:.1f}s to end\n{run.stderr}"
    assert code != 0, f"{what}: the launcher exited 0\n{run.stderr}"
    return code


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


# -- scenarios ---------------------------------------------------------------------------------


def rank_raises(mode: str) -> Any:
    def scenario(harness: Any) -> None:
        run = start(harness, mode, "--fail-rank", "1", "--fail-step", "3")
        out = harness.root / "out"
        harness.wait_for_files([out / "pid-rank1"], run)
        reached = time.monotonic()  # rank 1 is at step 2 and raises at its next step
        ended_within_deadline(run, reached, f"{mode}: rank 1 raised")
        stderr = run.stderr
        assert "injected failure at step 3 on rank 1" in stderr, stderr
        if mode == "torchrun":
            assert re.search(r"rank\s*:\s*1 ", stderr), stderr  # torchrun's root-cause table
        else:
            assert "RankFailedError: rank 1 exited with status 1" in stderr, stderr
            # The launcher's error carries rank 1's own traceback.
            report = stderr[stderr.index("RankFailedError: rank 1") :]
            assert "--- traceback of rank 1 ---" in report, stderr
            assert "injected failure at step 3 on rank 1" in report, stderr
        harness.assert_no_leftovers()

    return scenario


def rank_killed(mode: str) -> Any:
    def scenario(harness: Any) -> None:
        run = start(harness, mode)
        out = harness.root / "out"
        harness.wait_for_files([out / "pid-rank0", out / "pid-rank1"], run)
        os.kill(int((out / "pid-rank1").read_text()), signal.SIGKILL)
        ended_within_deadline(run, time.monotonic(), f"{mode}: rank 1 killed")
        assert "RankFailedError: rank 1 was killed by signal 9" in run.stderr, run.stderr
        harness.assert_no_leftovers()

    return scenario


def rank_leaves(mode: str) -> Any:
    """Rank 1 calls ``os._exit(0)`` mid-fit: to a launcher, status 0 looks like success, and
    its peer then fails inside a collective ("Connection closed by peer")."""

    def scenario(harness: Any) -> None:
        run = start(harness, mode, "--leave-rank", "1", "--leave-step", "3")
        out = harness.root / "out"
        harness.wait_for_files([out / "leaving-rank1"], run)
        ended_within_deadline(run, time.monotonic(), f"{mode}: rank 1 left with status 0")
        stderr = run.stderr
        # The rank that left is named, as the one that left; the survivor is not blamed.
        assert "RankFailedError: rank 1 left the job early" in stderr, stderr
        assert "RankFailedError: rank 0" not in stderr, stderr
        if mode != "torchrun":
            assert "(exited with status 0 before its fit finished)" in stderr, stderr
        # Who stopped the others, truly: cardcage's launcher, or torchrun (cardcage did not).
        stopped = "torchrun stops the other ranks" if mode == "torchrun" else "every other rank"
        assert f"; {stopped}" in stderr, stderr
        harness.assert_no_leftovers()

    return scenario


def launcher_signalled(mode: str, sig: signal.Signals) -> Any:
    def scenario(harness: Any) -> None:
        run = start(harness, mode)
        out = harness.root / "out"
        harness.wait_for_files([out / "pid-rank0", out / "pid-rank1"], run)
        ranks = {int((out / f"pid-rank{r}").read_text()) for r in (0, 1)} - {run.pid}
        os.kill(run.pid, sig)
        code = ended_within_deadline(run, time.monotonic(), f"{mode}: {sig.name} to launcher")
        # The launcher stopped its children itself, then exited 128 + the signal number.
        assert code == 128 + sig, f"exit {code}\n{run.stderr}"
        survivors = [pid for pid in ranks if not _gone(pid)]
        assert not survivors, f"ranks {survivors} outlived the launcher"
        harness.assert_no_leftovers()

    return scenario


SCENARIOS = {
    **{f"raise-{mode}": rank_raises(mode) for mode in ("relaunch", "spawn", "torchrun")},
    **{f"sigkill-rank1-{mode}": rank_killed(mode) for mode in ("relaunch", "spawn")},
    **{f"leave0-rank1-{mode}": rank_leaves(mode) for mode in ("relaunch", "spawn", "torchrun")},
    **{
        f"{sig.name}-launcher-{mode}": launcher_signalled(mode, sig)
        for mode in ("relaunch", "spawn")
        for sig in (signal.SIGTERM, signal.SIGINT)
    },
}


@pytest.mark.parametrize("scenario", ["raise-relaunch", "raise-spawn", "raise-torchrun"])
def test_a_rank_that_raises_at_step_3_ends_the_job_naming_it(scenarios: Any, scenario: str) -> None:
    scenarios.result(scenario)


@pytest.mark.parametrize("scenario", ["sigkill-rank1-relaunch", "sigkill-rank1-spawn"])
def test_a_rank_killed_mid_training_ends_the_job_naming_it(scenarios: Any, scenario: str) -> None:
    scenarios.result(scenario)


@pytest.mark.parametrize(
    "scenario", ["leave0-rank1-relaunch", "leave0-rank1-spawn", "leave0-rank1-torchrun"]
)
def test_a_rank_that_exits_0_mid_fit_is_named_as_the_one_that_left(
    scenarios: Any, scenario: str
) -> None:
    scenarios.result(scenario)


@pytest.mark.parametrize(
    "scenario",
    [
        "SIGTERM-launcher-relaunch",
        "SIGTERM-launcher-spawn",
        "SIGINT-launcher-relaunch",
        "SIGINT-launcher-spawn",
    ],
)
def test_a_signal_to_the_launcher_stops_every_rank(scenarios: Any, scenario: str) -> None:
    scenarios.result(scenario)
