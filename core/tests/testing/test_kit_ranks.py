"""The conformance kit seeds each rank apart and compares every rank's result."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from cardcage.testing import job
from cardcage.testing.harness import Harness
from cardcage.testing.models import KitModel, flat, make_net, seed_for_rank
from cardcage.testing.suite import SCENARIOS, JobOutput, Launch, run_job
from cardcage.testing.training_checks import TrainingChecks

RANK_VARIABLES = (*job.RANK_VARIABLES, "NODE_RANK")


@pytest.mark.parametrize(
    ("env", "rank"),
    [
        ({}, 0),
        ({"RANK": "3", "NODE_RANK": "1"}, 3),
        ({"HOROVOD_RANK": "1"}, 1),
        ({"JSM_NAMESPACE_RANK": "1", "JSM_NAMESPACE_LOCAL_RANK": "1"}, 1),  # jsrun
        ({"NODE_RANK": "1"}, 1),  # a node started by hand, before its backend sets RANK
    ],
)
def test_the_job_reads_each_launchers_rank(
    env: dict[str, str], rank: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert job._rank() == rank


def test_only_rank_0_builds_the_plain_loops_initial_weights() -> None:
    try:
        seed_for_rank(0)
        assert flat(KitModel()) == flat(make_net(0))
        seed_for_rank(1)
        assert flat(KitModel()) != flat(make_net(0))
        assert flat(KitModel(seed=99)) != flat(make_net(99))
    finally:
        seed_for_rank(0)


class OneScenario(TrainingChecks):
    backend = "cpu"
    launches = {"in_process": Launch({"distributed_backend": "cpu"})}
    skip = {s: "not run by this test" for s in SCENARIOS if s != "adam_shuffled"}


@pytest.fixture(scope="module")
def cpu_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JobOutput]:
    harness = Harness(tmp_path_factory.mktemp("ranks_job"))
    try:
        launch = OneScenario.launches["in_process"]
        yield run_job(harness, launch, ["adam_shuffled"], harness.root / "out")
    finally:
        harness.cleanup()


@pytest.fixture
def copied(cpu_job: JobOutput, tmp_path: Path) -> JobOutput:
    shutil.copytree(cpu_job.out, tmp_path / "out")
    return dataclasses.replace(cpu_job, out=tmp_path / "out")


def write_rank(output: JobOutput, rank: int, shift: float) -> None:
    """Rank 0's result, as rank ``rank`` with every weight moved by ``shift``."""
    result = output.result("adam_shuffled")
    result.update(rank=rank, weights=[w + shift for w in result["weights"]])
    (output.out / f"adam_shuffled-rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_another_ranks_weights_are_compared(copied: JobOutput) -> None:
    """Rank 1 equal to rank 0 passes; rank 1 off the plain loop fails, naming rank 1
    (only rank 0's result was read before)."""
    suite = OneScenario()
    write_rank(copied, 1, 0.0)
    suite.test_trains_like_a_plain_loop(copied, "adam_shuffled")
    write_rank(copied, 1, 0.01)
    with pytest.raises(AssertionError, match=r"adam_shuffled \(weights, rank 1\)"):
        suite.test_trains_like_a_plain_loop(copied, "adam_shuffled")


@pytest.mark.slow
def test_a_rank_the_kit_started_must_write_its_result(copied: JobOutput) -> None:
    """Under a launch that starts every rank's script, a rank without a result fails (two
    processes that took one rank's file); rank 0's is required under any launch."""
    ranks = dataclasses.replace(copied, launch=Launch({}, world_size=2, command="ranks"))
    with pytest.raises(AssertionError, match=r"adam_shuffled result of rank\(s\) \[1\]"):
        ranks.results("adam_shuffled")
    write_rank(copied, 1, 0.0)
    (copied.out / "adam_shuffled-rank0.json").unlink()
    with pytest.raises(AssertionError, match=r"adam_shuffled result of rank\(s\) \[0\]"):
        copied.results("adam_shuffled")
