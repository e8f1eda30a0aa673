"""The Cage on real processes: 2 ranks x batch 8 train as 1 process x 16, on every launcher.

One job per backend (``scripts/cage_job.py``, sections run one after the other in the same
``launch``): ``ddp_spawn`` (parity, collectives, ``no_backward_sync``, save/load resume),
``fsdp_spawn`` (parity with the optimizer created before setup, resume), ``ddp`` (script
relaunch) and torchrun (``launch`` runs in place in each of its processes). Every rank's
weights and every process's value of ``launch`` are checked against a plain PyTorch loop
run here.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from cage_helpers import launch_values, max_difference, outputs, plain_weights, start

from cardcage.testing.harness import Harness

pytestmark = pytest.mark.slow

SPAWN_SECTIONS = "parity,collectives,no_sync,resume"


def job_of(*args: str, torchrun: bool = False, processes: int = 2) -> Any:
    """Run the job with ``args``; it must exit 0 and leave no process behind."""

    def scenario(harness: Harness) -> dict[str, Any]:
        run, out = start(harness, *args, torchrun=torchrun)
        run.check()
        harness.assert_no_leftovers()
        found = outputs(out)
        found["_out"] = str(out)
        found["_processes"] = processes
        return found

    return scenario


SCENARIOS = {
    "ddp_spawn": job_of(
        "--backend", "ddp_spawn", "--num-processes", "2", "--sections", SPAWN_SECTIONS
    ),
    "fsdp_spawn": job_of(
        "--backend", "fsdp_spawn", "--num-processes", "2", "--sections", "parity,resume"
    ),
    "ddp": job_of("--backend", "ddp", "--num-processes", "2", "--sections", "parity"),
    "torchrun": job_of(
        "--backend", "ddp", "--num-processes", "2", "--sections", "parity", torchrun=True
    ),
}
#: How many processes call ``launch`` and get its value: the caller of spawned workers;
#: the launching script and its relaunched child; each of torchrun's two.
CALLERS = {"ddp_spawn": 1, "fsdp_spawn": 1, "ddp": 2, "torchrun": 2}


@pytest.mark.parametrize("scenario", ["ddp_spawn", "ddp", "torchrun", "fsdp_spawn"])
def test_two_ranks_of_8_train_as_one_process_of_16(scenarios: Any, scenario: str, job: Any) -> None:
    found = scenarios.result(scenario)
    reference = plain_weights(job, job.sgd, job.EPOCHS)
    ranks = [found[f"parity-rank{rank}"] for rank in range(2)]
    for rank, result in enumerate(ranks):
        assert result["world_size"] == 2
        assert max_difference(result["weights"], reference) <= 1e-5, rank
        # state_dict is the user's module's: its own keys, no wrapper prefix
        assert result["keys"] == sorted(job.make_model().state_dict())
        # set up before setup (fsdp rebuilds it over the shards): class and settings kept
        assert (result["is_sgd"], result["momentum"]) == (True, 0.9)
    assert ranks[0]["weights"] == ranks[1]["weights"]
    # launch's value is rank 0's, in every process that called launch
    values = launch_values(found)
    assert len(values) == CALLERS[scenario], values
    for value in values:
        assert value["value"] == {"rank": 0, "weights": ranks[0]["weights"]}
    if scenario == "torchrun":  # launch ran in torchrun's two processes, ranks 0 and 1
        assert sorted(value["rank"] for value in values) == ["0", "1"]


@pytest.mark.parametrize("scenario", ["ddp_spawn"])
def test_collectives(scenarios: Any, scenario: str) -> None:
    found = scenarios.result(scenario)
    for rank in range(2):
        result = found[f"collectives-rank{rank}"]
        assert result["mine"] == [rank + 1.0, 10.0 * (rank + 1)]  # the input is left as it was
        assert result["mean"] == [1.5, 15.0]
        assert result["sum"] == [3.0, 30.0]
        assert result["gathered_shape"] == [2, 1, 2]  # (world_size, *shape)
        assert result["gathered"] == [[[0, 0]], [[1, 10]]]  # in rank order
        assert result["broadcast"] == {"from": 1, "items": [1, "x"]}  # rank 1's object
        assert result["flag_after_barrier"], "rank 0 passed the barrier before rank 1 came"


@pytest.mark.parametrize("scenario", ["ddp_spawn"])
def test_no_backward_sync_accumulates_without_communicating(
    scenarios: Any, scenario: str, job: Any
) -> None:
    """3 micro-batches a step, the first two inside no_backward_sync: the ranks' gradients
    differ after each backward inside (nothing was all-reduced) and agree after the third;
    the weights are those of the plain loop accumulating the global micro-batches."""
    found = scenarios.result(scenario)
    model = job.make_model(3)
    optimizer = job.sgd(model)
    batches = job.loader(job.GLOBAL_BATCH, job.NO_SYNC_SAMPLES)
    job.accumulate(
        model, optimizer, batches, job.plain_backward, lambda _: contextlib.nullcontext()
    )
    reference = job.weights(model)
    for rank in range(2):
        result = found[f"no_sync-rank{rank}"]
        assert result["differ"] == {"inside": [True] * 4, "outside": [False] * 2}
        assert max_difference(result["weights"], reference) <= 1e-5, rank


@pytest.mark.parametrize("scenario", ["ddp_spawn", "fsdp_spawn"])
def test_save_then_load_resumes_adam_to_the_uninterrupted_weights(
    scenarios: Any, scenario: str, job: Any
) -> None:
    found = scenarios.result(scenario)
    reference = plain_weights(job, job.adam, job.RESUME_EPOCHS, seed=5, shuffled=True)
    for rank in range(2):
        result = found[f"resume-rank{rank}"]
        assert max_difference(result["straight"], reference) <= 1e-5
        # the model of another seed took the saved weights, then Adam went on where it was
        assert result["before_load"] != result["saved"]
        assert result["loaded"] == result["saved"]
        assert max_difference(result["resumed"], result["straight"]) <= 1e-6, rank
        # load returns the file's entries that are not modules or optimizers
        assert result["returned"] == {"epoch": 1, "note": "after one epoch", "list": [1, 2.5]}
    saved = torch.load(f"{found['_out']}/resume.ckpt", weights_only=True)
    assert set(saved) == {"model", "optimizer", "epoch", "note", "list"}
    expected = job.make_model().state_dict()
    # the user's own state_dict keys (no "module." or fsdp prefix), full shapes
    assert {k: tuple(v.shape) for k, v in saved["model"].items()} == {
        k: tuple(v.shape) for k, v in expected.items()
    }
    assert all(type(v) is torch.Tensor for v in saved["model"].values())
    state = saved["optimizer"]["state"]
    shapes = [tuple(p.shape) for p in expected.values()]
    assert sorted(state) == list(range(len(shapes)))
    for index, shape in enumerate(shapes):
        assert tuple(state[index]["exp_avg"].shape) == shape
        assert type(state[index]["exp_avg"]) is torch.Tensor  # not a DTensor shard
    assert saved["optimizer"]["param_groups"][0]["lr"] == 0.01
