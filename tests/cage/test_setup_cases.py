"""What ``cage.setup`` and ``setup_dataloaders`` must keep of the user's objects, on two
real processes of ``ddp_spawn`` and ``fsdp_spawn`` (``scripts/cage_job.py``'s sections):

- ``scheduler``: a LambdaLR warm-up from 0 made before ``setup`` drives the optimizer that
  steps (fsdp re-binds the user's optimizer to the shards in place, it does not build a
  new one the scheduler would not know): the weights are a plain PyTorch loop's.
- ``foreign``: ``cage.setup(model, optimizer)`` with an optimizer over another module's
  parameters is refused, naming the optimizer and the fix (here and in one process on the
  CPU), before any training.
- ``sampler``: a loader with a ``SubsetRandomSampler`` of its own over 8 indices is sharded:
  the 2 ranks see disjoint halves covering the 8, in a new order each epoch.
- ``bf16``: ``precision='bf16'`` under a spawn launch (``ddp_spawn``, ``fsdp_spawn``): the
  spawned workers get the precision (it pickles) and forward in bfloat16.
"""

from __future__ import annotations

from typing import Any

import pytest
from cage_helpers import max_difference, outputs, plain_weights, start

import cardcage
from cardcage.testing.harness import Harness

pytestmark = pytest.mark.slow

SECTIONS = "scheduler,foreign,sampler"


def job_of(*args: str) -> Any:
    def scenario(harness: Harness) -> dict[str, Any]:
        run, out = start(harness, *args)
        run.check()
        harness.assert_no_leftovers()
        return outputs(out)

    return scenario


SCENARIOS = {
    backend: job_of("--backend", backend, "--num-processes", "2", "--sections", SECTIONS)
    for backend in ("ddp_spawn", "fsdp_spawn")
}
for backend in ("ddp_spawn", "fsdp_spawn"):
    SCENARIOS[f"{backend}-bf16"] = job_of(
        "--backend", backend, "--num-processes", "2", "--sections", "bf16", "--precision", "bf16"
    )


def plain_scheduled(job: Any) -> tuple[list[float], list[float]]:
    """The plain loop's weights and learning rates: one process over the global batches."""
    model = job.make_model()
    optimizer = job.sgd(model)
    schedule = job.warmup(optimizer)
    batches = job.loader(job.GLOBAL_BATCH)
    rates = job.train_scheduled(model, optimizer, schedule, batches, job.EPOCHS, job.plain_backward)
    return job.weights(model), rates


@pytest.mark.parametrize("scenario", ["ddp_spawn", "fsdp_spawn"])
def test_a_scheduler_made_before_setup_drives_the_optimizer_that_steps(
    scenarios: Any, scenario: str, job: Any
) -> None:
    reference, rates = plain_scheduled(job)
    assert rates[0] == 0.0 and rates[-1] == pytest.approx(0.05)  # a warm-up from 0
    ranks = [scenarios.result(scenario)[f"scheduler-rank{rank}"] for rank in range(2)]
    for rank, result in enumerate(ranks):
        assert result["same_optimizer"], "setup must keep the optimizer object the user holds"
        assert result["scheduler_holds_it"]
        assert result["momentum"] == 0.9
        assert result["rates"] == pytest.approx(rates, abs=0, rel=1e-12), rank
        assert max_difference(result["weights"], result["initial"]) > 1e-2, "it did not train"
        assert max_difference(result["weights"], reference) <= 1e-5, rank
    assert ranks[0]["weights"] == ranks[1]["weights"]


FOREIGN = (
    "cage.setup: the SGD holds 4 parameter(s), none of them a parameter of the module set up "
    "(Sequential): stepping it would never train the model. Pass the optimizer built over "
    "this model's parameters: SGD(model.parameters(), ...) of the model you pass to cage.setup."
)


@pytest.mark.parametrize("scenario", ["ddp_spawn", "fsdp_spawn"])
def test_an_optimizer_of_another_module_is_refused(scenarios: Any, scenario: str) -> None:
    for rank in range(2):
        found = scenarios.result(scenario)[f"foreign-rank{rank}"]
        assert found == {"type": "MisconfigurationError", "message": FOREIGN}, rank


@pytest.mark.parametrize("split", [False, True])
def test_an_optimizer_of_another_module_is_refused_in_one_process(job: Any, split: bool) -> None:
    cage = cardcage.Cage()
    model, other = job.make_model(), job.make_model(1)
    before = job.weights(model)
    with pytest.raises(cardcage.MisconfigurationError) as raised:
        if split:
            cage.setup_module(model)
            cage.setup_optimizers(job.sgd(other))
        else:
            cage.setup(model, job.sgd(other))
    assert str(raised.value) == FOREIGN
    assert job.weights(model) == before
    # the optimizer of the model itself is taken, after the refusal too
    mine = job.make_model()
    ready = cardcage.Cage().setup(mine, job.sgd(mine))
    assert len(ready) == 2


@pytest.mark.parametrize("scenario", ["ddp_spawn", "fsdp_spawn"])
def test_a_loader_with_its_own_sampler_is_sharded(scenarios: Any, scenario: str, job: Any) -> None:
    ranks = [scenarios.result(scenario)[f"sampler-rank{rank}"] for rank in range(2)]
    orders = []
    for epoch in range(2):
        first, second = (ranks[rank]["epochs"][epoch] for rank in range(2))
        assert len(first) == len(second) == 4, (first, second)
        assert not set(first) & set(second), epoch
        assert sorted(first + second) == job.SUBSET, epoch
        orders.append(first + second)
    assert orders[0] != orders[1], "set_epoch must reach the sampler: a new order each epoch"
    assert [rank["length"] for rank in ranks] == [2, 2]  # batches of 2 of each rank's 4


@pytest.mark.parametrize("scenario", ["ddp_spawn-bf16", "fsdp_spawn-bf16"])
def test_bf16_trains_in_spawned_workers(scenarios: Any, scenario: str, job: Any) -> None:
    reference = plain_weights(job, job.sgd, job.EPOCHS)
    initial = job.weights(job.make_model())
    ranks = [scenarios.result(scenario)[f"bf16-rank{rank}"] for rank in range(2)]
    for rank, result in enumerate(ranks):
        assert result["dtypes"] == ["torch.bfloat16"], rank
        assert max_difference(result["weights"], initial) > 1e-2, "it did not train"
        assert max_difference(result["weights"], reference) <= 5e-2, rank  # bf16's rounding
    assert ranks[0]["weights"] == ranks[1]["weights"]
