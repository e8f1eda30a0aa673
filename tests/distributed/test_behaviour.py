"""What a distributed run does besides the arithmetic: refusing an unpicklable loader before
spawning, a second fit joining the relaunched processes, the user's sampler left alone, a
shuffling DistributedSampler, reduced validation metrics, one progress bar, one checkpoint
write that every rank waits for, and torch's thread count per process.

Three jobs (scenarios) run concurrently and several tests read each one's output.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import default_collate

import cardcage
from cardcage import MisconfigurationError
from cardcage.backend.launch import rendezvous
from cardcage.checkpoints import io as checkpoint

pytestmark = pytest.mark.slow

SAMPLES = 64
CPU_SHARE = max(1, (os.cpu_count() or 1) // 2)  # each of two local processes' threads
OMP_SET = CPU_SHARE + 1  # a value the per-process share would never give


def probes(harness: Any) -> dict[str, Any]:
    """ddp relaunch, shuffled, two epochs, validation, a bar, a checkpoint; OMP unset."""
    out = harness.root / "out"
    checkpoint = out / "ckpt" / "last.pt"
    run = harness.python_job(
        out,
        *("--backend", "ddp", "--num-processes", "2", "--epochs", "2"),
        *("--shuffle", "--val", "--progress-bar", "--checkpoint", str(checkpoint)),
    ).check()
    data = {
        "run": run,
        "stderr": run.stderr,
        "results": harness.results(out),
        "infos": harness.infos(out),
        "checkpoint": checkpoint,
    }
    harness.assert_no_leftovers()
    return data


def own_sampler(harness: Any) -> dict[str, Any]:
    """ddp_spawn with replace_sampler_ddp=False and OMP_NUM_THREADS set."""
    out = harness.root / "out"
    env = harness.env(OMP_NUM_THREADS=str(OMP_SET))
    run = harness.python_job(
        out, "--backend", "ddp_spawn", "--num-processes", "2", "--no-replace-sampler", env=env
    ).check()
    data = {"run": run, "results": harness.results(out), "infos": harness.infos(out)}
    harness.assert_no_leftovers()
    return data


def fit_twice(harness: Any) -> dict[str, Any]:
    """ddp relaunch; the script calls fit twice (a new Trainer the second time)."""
    out = harness.root / "out"
    run = harness.python_job(out, "--backend", "ddp", "--num-processes", "2", "--fit-twice")
    run.check()
    data = {"run": run, "results": harness.results(out), "infos": harness.infos(out)}
    harness.assert_no_leftovers()
    return data


SCENARIOS = {"probes": probes, "own-sampler": own_sampler, "fit-twice": fit_twice}


def assert_close(weights: list[float], reference: list[float]) -> None:
    worst = max(abs(a - b) for a, b in zip(weights, reference, strict=True))
    assert worst <= 1e-5, f"{weights} vs {reference}"


# -- before any process -----------------------------------------------------------------------


def test_ddp_spawn_refuses_a_lambda_collate_fn_naming_train_dataloader(tmp_path: Path) -> None:
    module = _job_module()
    model = module.Job(module.options(["--out", str(tmp_path)]))
    loader = DataLoader(module.Indexed(16), batch_size=8, collate_fn=lambda b: default_collate(b))
    trainer = cardcage.Trainer(distributed_backend="ddp_spawn", num_processes=2)
    before = set(os.listdir("/proc"))
    with pytest.raises(MisconfigurationError, match=r"train_dataloader.*cannot be pickled"):
        trainer.fit(model, train_dataloader=loader)
    assert multiprocessing.active_children() == []
    assert rendezvous.hosted_store() is None  # not even the rendezvous store was started
    started = [
        pid
        for pid in set(os.listdir("/proc")) - before
        if pid.isdigit() and _parent(int(pid)) == os.getpid()
    ]
    assert started == []


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _job_module() -> Any:
    import importlib.util
    import sys

    name = "cardcage_distributed_test_job"
    if name not in sys.modules:
        path = Path(__file__).parent / "scripts" / "job.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


# -- fit twice --------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", ["fit-twice"])
def test_a_second_fit_joins_the_relaunched_processes(scenarios: Any, scenario: str) -> None:
    data = scenarios.result(scenario)
    # Each process printed once: the second fit started no further copy of the script.
    assert sorted(line["rank"] for line in data["run"].result_lines()) == [0, 1]
    results, infos = data["results"], data["infos"]
    assert results[0]["pid"] == data["run"].pid
    assert results[1]["pid"] == infos[1]["pid"]  # the child that trained both fits
    for rank in (0, 1):
        assert infos[rank]["epochs"] == [list(range(rank, SAMPLES, 2))] * 2
    # Two fits of one epoch each over unshuffled data: two epochs of batch 16.
    reference = _job_module().reference_weights(16, epochs=2)
    assert results[0]["weights"] == results[1]["weights"]
    assert_close(results[0]["weights"], reference)


# -- samplers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", ["own-sampler"])
def test_replace_sampler_ddp_false_leaves_the_users_sampler_alone(
    scenarios: Any, scenario: str
) -> None:
    data = scenarios.result(scenario)
    infos = data["infos"]
    assert sorted(infos) == [0, 1]
    for info in infos.values():
        assert info["epochs"] == [list(range(SAMPLES))]  # every rank saw every sample, in order
    # The same batches on both ranks, gradients averaged: one process of batch 8.
    assert_close(data["results"][0]["weights"], _job_module().reference_weights(8))


@pytest.mark.parametrize("scenario", ["probes"])
def test_a_shuffling_loader_gets_a_shuffling_distributed_sampler_reseeded_each_epoch(
    scenarios: Any, scenario: str
) -> None:
    infos = scenarios.result(scenario)["infos"]
    epochs = {rank: infos[rank]["epochs"] for rank in (0, 1)}
    for rank in (0, 1):
        assert len(epochs[rank]) == 2
        assert epochs[rank][0] != epochs[rank][1]  # set_epoch changed the order
        assert epochs[rank][0] != list(range(rank, SAMPLES, 2))  # and it is shuffled
    for epoch in (0, 1):
        first, second = epochs[0][epoch], epochs[1][epoch]
        assert len(first) == len(second) == SAMPLES // 2
        assert sorted(first + second) == list(range(SAMPLES))  # disjoint shards, all samples


# -- metrics, progress bar, checkpoint --------------------------------------------------------


@pytest.mark.parametrize("scenario", ["probes"])
def test_logged_validation_metrics_are_reduced_over_ranks(scenarios: Any, scenario: str) -> None:
    data = scenarios.result(scenario)
    results, infos = data["results"], data["infos"]
    logged = [results[rank]["logged_metrics"]["val_loss"] for rank in (0, 1)]
    assert logged[0] == logged[1]
    # Each rank validated its own shard (4 batches an epoch); the logged value is the mean
    # of the ranks' means for the last epoch.
    local = [infos[rank]["val_local"][-4:] for rank in (0, 1)]
    assert local[0] != local[1]
    expected = (sum(local[0]) / 4 + sum(local[1]) / 4) / 2
    assert logged[0] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("scenario", ["probes"])
def test_only_rank_0_shows_a_progress_bar(scenarios: Any, scenario: str) -> None:
    data = scenarios.result(scenario)
    assert [data["results"][rank]["progress_bar"] for rank in (0, 1)] == [True, False]
    stderr = data["stderr"]
    assert "epoch 0" in stderr and "epoch 1" in stderr
    # One bar per epoch, from one rank: each bar starts (0%) once.
    assert stderr.count("epoch 0:   0%") == stderr.count("epoch 1:   0%") == 1, stderr


@pytest.mark.parametrize("scenario", ["probes"])
def test_save_checkpoint_writes_once_on_rank_0_and_every_rank_waits(
    scenarios: Any, scenario: str
) -> None:
    data = scenarios.result(scenario)
    results = data["results"]
    assert [results[rank]["saves"] for rank in (0, 1)] == [1, 0]
    # Rank 0 slept a second before writing; rank 1 returned only once the file was there.
    assert [results[rank]["checkpoint_seen_after_save"] for rank in (0, 1)] == [True, True]
    path = data["checkpoint"]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left
    state = checkpoint.load(path)
    saved = [float(v) for t in state["state_dict"].values() for v in t.reshape(-1)]
    assert saved == pytest.approx(results[0]["weights"])


# -- threads ----------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", ["probes"])
def test_each_local_process_gets_its_share_of_the_cores_when_omp_is_unset(
    scenarios: Any, scenario: str
) -> None:
    infos = scenarios.result(scenario)["infos"]
    assert [(infos[r]["omp"], infos[r]["threads"]) for r in (0, 1)] == [(None, CPU_SHARE)] * 2


@pytest.mark.parametrize("scenario", ["own-sampler"])
def test_omp_num_threads_set_is_left_alone(scenarios: Any, scenario: str) -> None:
    infos = scenarios.result(scenario)["infos"]
    expected = (str(OMP_SET), OMP_SET)
    assert [(infos[r]["omp"], infos[r]["threads"]) for r in (0, 1)] == [expected] * 2
