"""max_restarts: rank 1 SIGKILLs itself at global step 7 of 8 (2 epochs, 2 processes,
checkpoint every 2 steps). fit restarts the job, resumes from the step-6 checkpoint and ends
with the weights of a run that was never interrupted, bit for bit; a rank that dies at every
attempt fails fit after max_restarts restarts, naming the rank; no process is left behind.
Under torchrun, torchrun restarts (--max-restarts) and cardcage resumes by itself."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from cardcage import MisconfigurationError, Trainer
from cardcage.testing.harness import Harness

JOB = Path(__file__).parent / "scripts" / "restart_job.py"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")

pytestmark = pytest.mark.slow


def run(
    harness: Harness, out: Path, backend: str, mode: str, *options: str, torchrun: bool = False
) -> Any:
    """Start restart_job.py; ``options``: its ``[MAX_RESTARTS] [KEY=VALUE...]``."""
    out.mkdir(parents=True)
    command = [sys.executable, str(JOB), str(out), backend, mode, *options]
    if torchrun:
        command = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
        command += [str(JOB), str(out), backend, mode, *options]
    return harness.start(command, name=f"{backend} {mode}")


def result(out: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((out / "result.json").read_text())
    return loaded


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    harness = Harness(tmp_path_factory.mktemp("straight"))
    try:
        run(harness, harness.root / "out", "ddp_spawn", "straight").check()
    finally:
        assert not harness.cleanup()
    weights: list[float] = result(harness.root / "out")["weights"]
    return weights


@pytest.mark.parametrize("backend", ["ddp_spawn", "ddp", "fsdp", "fsdp_spawn"])
def test_a_killed_rank_costs_one_restart(
    straight: list[float], tmp_path: Path, backend: str
) -> None:
    harness = Harness(tmp_path)
    try:
        job = run(harness, tmp_path / "out", backend, "once").check()
        harness.assert_no_leftovers()
    finally:
        assert not harness.cleanup()
    assert "rank 1 was killed by signal 9; restart 1 of max_restarts=2, from" in job.stderr
    done = result(tmp_path / "out")
    assert (done["restarts"], done["step"]) == (1, 8)
    assert done["weights"] == straight  # bit-equal to the uninterrupted run (ddp_spawn's)


def test_torchrun_max_restarts_resumes_from_default_root_dir(
    straight: list[float], tmp_path: Path
) -> None:
    harness = Harness(tmp_path)
    try:
        run(harness, tmp_path / "out", "ddp", "once", torchrun=True).check()
    finally:
        assert not harness.cleanup()
    assert (tmp_path / "out" / "killed").exists()  # the first attempt did die
    assert (tmp_path / "out" / "root" / "last.ckpt").exists()
    done = result(tmp_path / "out")
    assert (done["restarts"], done["step"]) == (0, 8)  # torchrun restarted, not cardcage
    assert done["weights"] == straight


@pytest.mark.parametrize("backend", ["ddp_spawn", "ddp"])
def test_a_rank_that_always_dies_fails_after_the_restarts(tmp_path: Path, backend: str) -> None:
    harness = Harness(tmp_path)
    try:
        job = run(harness, tmp_path / "out", backend, "always")
        assert job.wait() != 0
        harness.assert_no_leftovers()
    finally:
        assert not harness.cleanup()
    assert (
        "RankFailedError: rank 1 was killed by signal 9 after 2 restart(s), all that "
        "max_restarts=2 allows" in job.stderr
    )
    assert job.stderr.count("restart 2 of max_restarts=2") == 1
    assert not (tmp_path / "out" / "result.json").exists()


@pytest.mark.parametrize("backend", ["ddp_spawn", "ddp"])
def test_a_rank_that_leaves_early_is_named_so_by_the_restarts(tmp_path: Path, backend: str) -> None:
    """Rank 1 calls ``os._exit(0)`` at every attempt (max_restarts=1). Its status alone reads
    as a success: the restart's log line and the error once the restarts are spent say that
    it left the job early, as the launcher found, not that it "exited with status 0"."""
    harness = Harness(tmp_path)
    try:
        job = run(harness, tmp_path / "out", backend, "always", "1", "leave=0")
        assert job.wait() != 0
        harness.assert_no_leftovers()
    finally:
        assert not harness.cleanup()
    left = "rank 1 left the job early (exited with status 0 before its fit finished)"
    assert f"{left}; restart 1 of max_restarts=1, from" in job.stderr, job.output()
    assert (
        f"RankFailedError: {left} after 1 restart(s), all that max_restarts=1 allows; every "
        "other rank was stopped." in job.stderr
    ), job.output()
    assert "exited with status 0;" not in job.stderr
    assert not (tmp_path / "out" / "result.json").exists()


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ({"max_restarts": -1}, "max_restarts=-1"),
        ({"max_restarts": "two"}, "max_restarts='two'"),
        ({"max_restarts": True}, "max_restarts=True"),
        ({"checkpoint_every_n_steps": 0}, "checkpoint_every_n_steps=0"),
        ({"checkpoint_every_n_steps": 2.5}, "checkpoint_every_n_steps=2.5"),
    ],
)
def test_bad_values_name_the_flag(flags: dict[str, Any], named: str) -> None:
    with pytest.raises(MisconfigurationError, match=named):
        Trainer(**flags)
