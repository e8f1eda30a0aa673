"""``trainer.predict``: what one process returns, and that a job of several processes returns
the same, every sample once and in order, on every rank.

The in-process tests use the cpu backend. The slow ones run ``predict_job.py`` (next to this
file) as real jobs: two ranks started by torchrun, two by ``ddp``'s script relaunch, and a
``ddp_spawn`` fit whose caller predicts afterwards. Over 7 samples in batches of 2 the two
ranks' shards are padded (rank 1 gets sample 0 again) and the last batch is short, so only
predictions put back in order, without the padding, and cut into the loader's own batches
equal the plain loop's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import cardcage
from cardcage.testing.harness import Harness

JOB = Path(__file__).with_name("predict_job.py")
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


class Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)
        self.dropout = torch.nn.Dropout(0.5)  # eval mode turns it off

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.dropout(self.layer(x))
        return y


class WithStep(Linear):
    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        torch.rand(1)  # draws: fork_rng keeps the caller's random state
        return {"y": self(batch), "where": (batch_idx, dataloader_idx)}

    def predict_dataloader(self) -> DataLoader[Any]:
        return DataLoader(rows(5), batch_size=2)


def rows(count: int) -> Any:
    """A loader's data: ``count`` samples of 3 features, each batch one tensor."""
    return torch.randn(count, 3)


def trainer() -> cardcage.Trainer:
    return cardcage.Trainer(progress_bar=False)


def test_one_process_returns_the_plain_loops_outputs_batch_for_batch() -> None:
    model = Linear()
    model.train()
    loader = DataLoader(rows(7), batch_size=2)
    got = trainer().predict(model, loader)
    assert model.training  # eval while predicting, then put back
    model.eval()
    with torch.no_grad():
        expected = [model(x) for x in loader]
    assert len(got) == len(expected) == 4
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert not any(t.requires_grad for t in got)  # no_grad


def test_several_loaders_give_a_list_per_loader_with_dataloader_idx() -> None:
    model = WithStep()
    loaders = [DataLoader(rows(3), batch_size=2), DataLoader(rows(1))]
    state = torch.random.get_rng_state()
    got = trainer().predict(model, loaders)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert [[o["where"] for o in each] for each in got] == [[(0, 0), (1, 0)], [(0, 1)]]


def test_one_loader_passes_no_dataloader_idx_and_predict_dataloader_is_the_default() -> None:
    class TwoArguments(WithStep):
        def predict_step(self, batch: Any, batch_idx: int) -> Any:  # type: ignore[override]
            return self(batch)

    got = trainer().predict(TwoArguments())
    assert [tuple(t.shape) for t in got] == [(2, 2), (2, 2), (1, 2)]


def test_without_a_loader_or_a_model_it_says_what_to_pass() -> None:
    with pytest.raises(cardcage.MisconfigurationError, match=r"predict_dataloader\(\)"):
        trainer().predict(Linear())
    with pytest.raises(cardcage.MisconfigurationError, match=r"neither predict_step"):
        trainer().predict(dataloaders=DataLoader(rows(2)))


# -- real jobs ------------------------------------------------------------------------------

SCENARIOS = ["tensor", "dict", "two_loaders", "forward", "own_loader", "after_fit"]
#: The samples each rank's shard holds, in order (DistributedSampler: index i to rank i % 2,
#: padded with sample 0).
SHARDS = {0: [0, 2, 4, 6], 1: [1, 3, 5, 0]}


def run_job(root: Path, launcher: list[str], mode: str, scenarios: list[str]) -> Path:
    """Run ``predict_job.py`` under ``launcher``; the folder its ranks wrote to. No process
    of the job may outlive it."""
    harness = Harness(root)
    out = root / "out"
    try:
        harness.start([*launcher, str(JOB), str(out), mode, *scenarios]).check()
        harness.assert_no_leftovers()
    finally:
        harness.cleanup()
    return out


def results(out: Path, scenario: str, ranks: int) -> dict[int, dict[str, Any]]:
    return {r: json.loads((out / f"{scenario}-rank{r}.json").read_text()) for r in range(ranks)}


@pytest.fixture(scope="module")
def torchrun(tmp_path_factory: pytest.TempPathFactory) -> Path:
    launcher = [TORCHRUN, "--standalone", "--nproc-per-node=2"]
    scenarios = [*SCENARIOS, "shuffled", "refused"]
    return run_job(tmp_path_factory.mktemp("torchrun"), launcher, "torchrun", scenarios)


@pytest.fixture(scope="module")
def relaunch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first fit relaunches the script as rank 1; ``tensor`` then runs in the job that
    fit left (its process group stays until the script ends)."""
    root = tmp_path_factory.mktemp("relaunch")
    return run_job(root, [sys.executable], "relaunch", ["after_fit", "tensor"])


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_torchrun_rank_returns_what_one_process_returns(
    torchrun: Path, scenario: str
) -> None:
    """Each rank predicted its padded shard (``seen``), and each returns the single-process
    predictions exactly (``expected``: the plain loop over the whole loader), batch for
    batch. ``own_loader`` (``replace_sampler_ddp=False``): each rank predicts it all."""
    for rank, result in results(torchrun, scenario, 2).items():
        assert result["world_size"] == 2
        assert result["got"] == result["expected"], f"rank {rank}"
        assert result["training_after"] is True
        if scenario in ("tensor", "dict", "after_fit"):
            assert result["seen"] == SHARDS[rank]
        if scenario == "own_loader":
            assert result["seen"] == list(range(7))


@pytest.mark.slow
def test_two_loaders_come_back_as_a_list_per_loader(torchrun: Path) -> None:
    """The second loader (8 samples, batches of 3, ``drop_last=True``) keeps the two whole
    batches one process keeps, though each rank's shard of 4 would have dropped one."""
    got = results(torchrun, "two_loaders", 2)[0]["got"]
    assert [[batch["shape"][0] for batch in each] for each in got] == [[2, 2, 2, 1], [3, 3]]


@pytest.mark.slow
def test_a_shuffled_loader_gives_every_sample_once_in_the_same_order_on_every_rank(
    torchrun: Path,
) -> None:
    ranks = results(torchrun, "shuffled", 2)
    assert sorted(ranks[0]["indices"]) == list(range(7))
    assert ranks[0]["indices"] == ranks[1]["indices"]


@pytest.mark.slow
def test_outputs_that_cannot_be_split_per_sample_are_refused_on_every_rank(
    torchrun: Path,
) -> None:
    for result in results(torchrun, "refused", 2).values():
        assert "predict_step (or forward) returned str" in result["refused"]
        assert "replace_sampler_ddp=False" in result["refused"]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["after_fit", "tensor"])
def test_ranks_of_a_relaunched_ddp_job_return_what_one_process_returns(
    relaunch: Path, scenario: str
) -> None:
    for rank, result in results(relaunch, scenario, 2).items():
        assert result["world_size"] == 2
        assert result["got"] == result["expected"], f"rank {rank}"
        assert result["seen"] == SHARDS[rank]


@pytest.mark.slow
def test_after_a_ddp_spawn_fit_the_caller_predicts_everything_alone(tmp_path: Path) -> None:
    """The workers are gone: the caller predicts every sample itself, with the weights
    they handed back (``expected``: the plain loop with the model after fit)."""
    out = run_job(tmp_path, [sys.executable], "spawn", ["after_fit"])
    result = results(out, "after_fit", 1)[0]
    assert result["got"] == result["expected"]
    assert result["seen"] == list(range(7))
    assert result["training_after"] is True
