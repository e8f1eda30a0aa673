"""The Ray backends on a real Ray: a local Ray the job starts and stops, and the session's
two-node cluster (``conftest.py``). What is proven: two ranks of batch 8 reproduce one
process of batch 16; a job leaves no Ray process behind; ranks land on distinct nodes; a
killed actor costs one restart and the run ends with the uninterrupted weights; a failing or
stuck actor is named by rank and node; the selection refuses what Ray cannot run."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

import cardcage
from cardcage.testing.harness import Harness
from cardcage.testing.suite import ENVIRONMENTS

JOB = Path(__file__).parent / "ray_job.py"


def run(harness: Harness, out: Path, backend: str, mode: str, *options: str, **env: str) -> Any:
    out.mkdir(parents=True)
    command = [sys.executable, str(JOB), str(out), backend, mode, *options]
    return harness.start(command, harness.env(**env), name=f"{backend} {mode}")


def failed(harness: Harness, out: Path, backend: str, mode: str, *options: str, **env: str) -> str:
    """Run a job that must fail: its output, once no process of it is left."""
    job = run(harness, out, backend, mode, *options, **env)
    assert job.wait() != 0
    output: str = job.output()
    harness.assert_no_leftovers()
    return output


def result(out: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((out / "result.json").read_text())
    return loaded


def worst(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_a_local_ray_trains_like_one_process_and_is_stopped(tmp_path: Path) -> None:
    """No RAY_ADDRESS: the job starts a Ray of its own (beside the session's cluster) and
    stops it; no process of it is left (the kit's marker is in its environment)."""
    harness = Harness(tmp_path)
    try:
        job = run(harness, tmp_path / "out", "ray", "plain", "nodes=1", "procs=2", RAY_ADDRESS="")
        job.check()
        assert "Started a local Ray instance" in job.output()
        harness.assert_no_leftovers()
    finally:
        harness.cleanup()
    got = result(tmp_path / "out")
    assert worst(got["weights"], got["plain"]) <= 1e-5
    assert got["children"] == [], "Ray's processes outlived fit"


def test_a_single_node_store_listens_on_loopback_only(tmp_path: Path) -> None:
    """A job of one node (a local Ray, 2 ranks): rank 0's actor hosts the process group's
    store on 127.0.0.1 alone, and the ranks dial 127.0.0.1 (before: a port picked with
    ``bind(("", 0))`` and torch's store listening on every interface)."""
    harness = Harness(tmp_path)
    try:
        job = run(harness, tmp_path / "out", "ray", "sockets", "nodes=1", "procs=2", RAY_ADDRESS="")
        job.check()
        harness.assert_no_leftovers()
    finally:
        harness.cleanup()
    found = json.loads((tmp_path / "out" / "sockets.json").read_text())
    assert found["master_addr"] == "127.0.0.1", found
    assert found["store"] == ["127.0.0.1"], found


def test_the_store_address_is_loopback_for_one_node_only() -> None:
    """Several nodes: the store listens on rank 0's node address, not on every interface."""
    from cardcage_ray import store_address

    assert store_address(1, "10.1.2.3") == "127.0.0.1"
    assert store_address(2, "10.1.2.3") == "10.1.2.3"


@pytest.mark.parametrize("backend", ["ray", "ray_fsdp"])
def test_two_nodes_train_like_one_process(tmp_path: Path, backend: str) -> None:
    harness = Harness(tmp_path)
    try:
        job = run(harness, tmp_path / "out", backend, "plain").check()
        assert "Connected to Ray cluster" in job.output()
        harness.assert_no_leftovers()
    finally:
        harness.cleanup()
    got = result(tmp_path / "out")
    assert worst(got["weights"], got["plain"]) <= 1e-5


def test_a_cage_runs_one_rank_per_node(tmp_path: Path) -> None:
    """The own loop on Ray: ``num_nodes=2`` puts its two ranks on the cluster's two nodes,
    and rank 0's return value comes back to the caller."""
    harness = Harness(tmp_path)
    out = tmp_path / "out"
    try:
        run(harness, out, "ray", "cage").check()
    finally:
        harness.cleanup()
    nodes = {(out / f"node-{rank}").read_text() for rank in range(2)}
    assert len(nodes) == 2, "both ranks ran on one Ray node"
    assert result(out)["returned"] == {"rank": 0, "world": 2}


@pytest.mark.parametrize("backend", ["ray", "ray_fsdp"])
def test_a_killed_actor_costs_one_restart(tmp_path: Path, backend: str) -> None:
    """Rank 1's actor is SIGKILLed at step 7 of 8: the actors start again from the step-6
    checkpoint (the second attempt's first step is 7) and the run ends with the weights of
    one that was never interrupted."""
    harness = Harness(tmp_path)
    try:
        run(harness, tmp_path / "straight", backend, "straight").check()
        job = run(harness, tmp_path / "once", backend, "once").check()
        assert (tmp_path / "once" / "killed").exists()
        assert "rank 1 died on Ray node 1" in job.output()
        harness.assert_no_leftovers()
    finally:
        harness.cleanup()
    straight, once = result(tmp_path / "straight"), result(tmp_path / "once")
    assert (straight["restarts"], once["restarts"]) == (0, 1)
    assert (tmp_path / "once" / "starts").read_text().split() == ["1", "7"]
    assert worst(once["weights"], straight["weights"]) == 0.0


def test_an_actor_killed_at_every_attempt_fails_the_fit(tmp_path: Path) -> None:
    harness = Harness(tmp_path)
    try:
        output = failed(harness, tmp_path / "out", "ray", "always")
    finally:
        harness.cleanup()
    assert "RankFailedError: rank 1 died on Ray node 1" in output
    assert "after 1 restart(s), all that max_restarts=1 allows" in output


def test_a_failing_actor_is_named_by_rank_and_node(tmp_path: Path) -> None:
    harness = Harness(tmp_path)
    try:
        output = failed(harness, tmp_path / "out", "ray", "raise")
    finally:
        harness.cleanup()
    assert "RankFailedError: rank 1 raised an exception on Ray node 1" in output
    assert "RuntimeError: rank 1 gives up" in output


def test_a_stuck_actor_is_named_with_its_stack(tmp_path: Path) -> None:
    """Rank 1 sleeps inside training_step: the watcher names it, its node and its stack
    after CARDCAGE_TIMEOUT, and every actor is stopped."""
    harness = Harness(tmp_path)
    try:
        output = failed(
            harness, tmp_path / "out", "ray", "stuck", CARDCAGE_STUCK_WARN="2", CARDCAGE_TIMEOUT="6"
        )
    finally:
        harness.cleanup()
    assert "RankFailedError: rank 1 is stuck" in output
    assert "on Ray node 1" in output
    assert "in training_step" in output  # its stack


def test_a_cluster_without_room_is_named(tmp_path: Path) -> None:
    """num_nodes=3 on a two-node cluster: the placement group cannot be placed, and the
    error names the flags and what the cluster has, after CARDCAGE_INIT_TIMEOUT."""
    harness = Harness(tmp_path)
    try:
        output = failed(
            harness, tmp_path / "out", "ray", "plain", "nodes=3", CARDCAGE_INIT_TIMEOUT="3"
        )
    finally:
        harness.cleanup()
    assert (
        "MisconfigurationError: distributed_backend='ray' asks the Ray cluster for 3 node(s)"
        in output
    )
    assert "it has 2 node(s)" in output


def test_several_nodes_need_a_cluster(tmp_path: Path) -> None:
    """num_nodes=2 with no cluster named: refused at once, before a local Ray starts."""
    harness = Harness(tmp_path)
    try:
        output = failed(harness, tmp_path / "out", "ray", "plain", "nodes=2", RAY_ADDRESS="")
    finally:
        harness.cleanup()
    assert (
        "MisconfigurationError: distributed_backend='ray' with num_nodes=2 needs a Ray cluster"
        in output
    )
    assert "Started a local Ray" not in output


TORCHRUN_RANK1 = ENVIRONMENTS["torchrun_rank1"]


@pytest.mark.parametrize("backend", ["ray", "ray_fsdp"])
def test_selected_by_name_only(backend: str) -> None:
    """Named, it is chosen; unnamed, no rule of it claims a job (another backend, or none
    where it is the only plugin installed, as in its nox session)."""
    assert (
        cardcage.select(distributed_backend=backend, num_processes=2, env={}).accelerator == backend
    )
    try:
        chosen = cardcage.select(num_processes=2, num_nodes=2, env={}).accelerator
    except cardcage.MisconfigurationError:
        chosen = None
    assert chosen not in ("ray", "ray_fsdp")


def test_processes_of_another_launcher_are_refused() -> None:
    with pytest.raises(
        cardcage.MisconfigurationError, match=r"distributed_backend='ray' under torchelastic"
    ):
        cardcage.select(distributed_backend="ray", env=TORCHRUN_RANK1)
