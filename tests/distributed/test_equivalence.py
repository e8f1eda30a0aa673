"""Numerical equivalence on the CPU (gloo): N processes of batch 8 over unshuffled data
reproduce one process of batch 8N, computed by a plain PyTorch loop, for every way cardcage's
processes come to exist: spawn, script relaunch, torchrun, a manual two-node launch, torchrun
on two nodes, and ddp2 on two nodes. Ranks, world size and data shards are checked too.
The spawn and relaunch jobs run two at a time without MASTER_PORT: both must finish (each
launcher hosts its rendezvous store on a port the kernel picks, so they never race).

The scenarios run concurrently (see ``conftest.py``); each test reports one of them.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.slow

TOLERANCE = 1e-5
SAMPLES = 64
BATCH = 8


def assert_close(weights: list[float], reference: list[float]) -> None:
    assert len(weights) == len(reference)
    worst = max(abs(a - b) for a, b in zip(weights, reference, strict=True))
    assert worst <= TOLERANCE, f"weights {weights} differ from {reference} by {worst:g}"


def assert_shards(infos: dict[int, dict[str, Any]], world: int) -> None:
    """Every rank of ``world`` trained, knew its place, and saw its strided shard."""
    assert sorted(infos) == list(range(world))
    for rank, info in infos.items():
        assert (info["dist_rank"], info["world"]) == (rank, world)
        assert info["first_index"] == rank
        assert info["epochs"] == [list(range(rank, SAMPLES, world))]
    assert len({info["pid"] for info in infos.values()}) == world


# -- scenarios ---------------------------------------------------------------------------------


def two_jobs_at_once(backend: str) -> Any:
    """Two jobs of ``backend`` started at once, without MASTER_PORT (each launcher hosts
    its store on a port the kernel picks), each checked against the plain loop."""

    def scenario(harness: Any) -> None:
        env = harness.env()
        assert "MASTER_PORT" not in env
        outs = [harness.root / f"job{i}" for i in (0, 1)]
        runs = [
            harness.python_job(out, "--backend", backend, "--num-processes", "2", env=env)
            for out in outs
        ]
        for run, out in zip(runs, outs, strict=True):
            run.check()
            (check_spawned if backend == "ddp_spawn" else check_relaunched)(harness, run, out)
        harness.assert_no_leftovers()

    return scenario


def check_spawned(harness: Any, run: Any, out: Any) -> None:
    results = harness.results(out)
    assert list(results) == [0]  # only the launching process ran the script to its end
    assert results[0]["accelerator"] == "ddp_spawn"
    assert results[0]["global_step"] == SAMPLES // (2 * BATCH)
    assert_close(results[0]["weights"], harness.reference(2 * BATCH))
    infos = harness.infos(out)
    assert_shards(infos, 2)
    assert run.pid not in {info["pid"] for info in infos.values()}  # spawned workers trained


def check_relaunched(harness: Any, run: Any, out: Any) -> None:
    printed = {line["rank"]: line for line in run.result_lines()}
    assert sorted(printed) == [0, 1], run.stdout  # the parent and the relaunched child
    reference = harness.reference(2 * BATCH)
    for line in printed.values():
        assert (line["accelerator"], line["trained_by"]) == ("ddp", "ddp")
        assert_close(line["weights"], reference)
    assert printed[0]["weights"] == printed[1]["weights"]
    assert printed[0]["pid"] == run.pid  # the launching process trained as rank 0
    assert (printed[0]["cluster"], printed[1]["cluster"]) == ("local", "torchelastic")
    assert_shards(harness.infos(out), 2)


def torchrun(args: list[str], rule: str) -> Any:
    def scenario(harness: Any) -> None:
        out = harness.root / "out"
        run = harness.torchrun_job(out, ["--nproc-per-node=2", "--standalone"], *args).check()
        results = harness.results(out)
        assert sorted(results) == [0, 1], run.stdout
        reference = harness.reference(2 * BATCH)
        for result in results.values():
            assert (result["accelerator"], result["cluster"], result["rule"]) == (
                "ddp",
                "torchelastic",
                rule,
            )
            assert_close(result["weights"], reference)
        assert_shards(harness.infos(out), 2)
        assert run.pid not in {r["pid"] for r in results.values()}
        harness.assert_no_leftovers()

    return scenario


def two_nodes(how: str, per_node: int, backend: list[str], expect: tuple[str, str]) -> Any:
    """Node 0 and node 1 of one job on loopback, started by hand or by two torchruns."""

    def scenario(harness: Any) -> None:
        out = harness.root / "out"
        port = str(harness.free_port())
        args = ["--num-nodes", "2", "--num-processes", str(per_node), *backend]
        runs = []
        for node in (0, 1):
            if how == "manual":
                env = harness.env(NODE_RANK=str(node), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                runs.append(harness.python_job(out, *args, env=env))
            else:
                launcher = [
                    "--nnodes=2",
                    f"--nproc-per-node={per_node}",
                    f"--node-rank={node}",
                    "--master-addr=127.0.0.1",
                    f"--master-port={port}",
                ]
                runs.append(harness.torchrun_job(out, launcher, *args))
        for run in runs:
            run.check()
        infos = harness.infos(out)
        world = 2 * per_node
        assert_shards(infos, world)
        for rank, info in infos.items():
            assert (int(info["node_rank"]), info["local_rank"]) == divmod(rank, per_node)
        results = harness.results(out)
        assert sorted(results) == list(range(world))
        reference = harness.reference(world * BATCH)
        for result in results.values():
            assert_close(result["weights"], reference)
            assert (result["accelerator"], result["rule"]) == expect
        harness.assert_no_leftovers()

    return scenario


SCENARIOS = {
    # Each runs two jobs at once: equivalence, and no race for a port.
    "ddp_spawn-x2": two_jobs_at_once("ddp_spawn"),
    "ddp-relaunch-x2": two_jobs_at_once("ddp"),
    # Trainer() under torchrun: rule 300 (a cluster created the processes) picks ddp.
    "torchrun-no-backend": torchrun([], "multi_node_or_cluster"),
    "torchrun-ddp_spawn-runs-as-ddp": torchrun(
        ["--backend", "ddp_spawn", "--num-processes", "2"], "distributed_backend"
    ),
    # No backend named: num_nodes > 1 makes rule 300 pick ddp; each node relaunches one child.
    "2x2-manual": two_nodes("manual", 2, [], ("ddp", "multi_node_or_cluster")),
    "2x2-torchrun": two_nodes("torchrun", 2, [], ("ddp", "multi_node_or_cluster")),
    "ddp2-2x1-manual": two_nodes(
        "manual", 1, ["--backend", "ddp2"], ("ddp2", "distributed_backend")
    ),
}


@pytest.mark.parametrize("scenario", ["ddp_spawn-x2"])
def test_ddp_spawn_two_processes_match_one_of_double_batch(scenarios: Any, scenario: str) -> None:
    scenarios.result(scenario)


@pytest.mark.parametrize("scenario", ["ddp-relaunch-x2"])
def test_ddp_relaunch_parent_and_child_match_one_process_of_double_batch(
    scenarios: Any, scenario: str
) -> None:
    scenarios.result(scenario)


@pytest.mark.parametrize("scenario", ["torchrun-no-backend", "torchrun-ddp_spawn-runs-as-ddp"])
def test_torchrun_two_processes_match_one_of_double_batch(scenarios: Any, scenario: str) -> None:
    scenarios.result(scenario)


@pytest.mark.parametrize("scenario", ["2x2-manual", "2x2-torchrun"])
def test_two_nodes_of_two_processes_match_one_of_quadruple_batch(
    scenarios: Any, scenario: str
) -> None:
    scenarios.result(scenario)


@pytest.mark.parametrize("scenario", ["ddp2-2x1-manual"])
def test_ddp2_two_nodes_of_one_process_match_one_of_double_batch(
    scenarios: Any, scenario: str
) -> None:
    scenarios.result(scenario)
