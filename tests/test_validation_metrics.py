"""Validation and test metrics are means weighted by batch size, over every process: with
batches of 64 and 36 samples the logged mean is the mean over the 100 samples (0.36 below),
not the mean of the two batch means (0.5)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage
from cardcage.config.model_contract import batch_size

# 100 samples whose last 36 are positive: batch means 0 and 1, sample mean 0.36
LABELS = torch.cat([torch.zeros(64), torch.ones(36)])


class Counting(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return (self.w - 1).pow(2).sum()

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        return {"positive": batch["y"].mean(), "loss": batch["y"].mean() * 2}

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        labels: torch.Tensor = batch["y"]
        return labels.mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def uneven() -> DataLoader[Any]:
    data = [{"y": y} for y in LABELS]  # dict batches: the size is found inside them
    return DataLoader(data, batch_size=64)  # type: ignore[arg-type]


def test_batch_size_is_dim_0_of_the_first_tensor() -> None:
    assert batch_size((torch.zeros(5, 2), torch.zeros(7))) == 5
    assert batch_size({"x": [torch.zeros(3)], "y": torch.zeros(9)}) == 3
    assert batch_size(["text", torch.zeros(4)]) == 4
    assert batch_size(torch.tensor(1.0)) == 1


def test_validation_and_test_means_are_weighted_by_batch_size() -> None:
    trainer = cardcage.Trainer(max_epochs=1, progress_bar=False)
    trainer.fit(Counting(), DataLoader(TensorDataset(torch.zeros(4)), batch_size=2), uneven())
    assert trainer.logged_metrics["val_positive"] == pytest.approx(0.36, abs=1e-12)
    assert trainer.logged_metrics["val_loss"] == pytest.approx(0.72, abs=1e-12)
    assert trainer.validate(dataloaders=uneven())[0]["val_positive"] == pytest.approx(0.36)
    assert trainer.test(dataloaders=uneven()) == [{"test_loss": pytest.approx(0.36)}]


SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
import cardcage


class Split:
    '''Rank 0 validates 64 negative samples, rank 1 the 36 positive ones.'''

    def __iter__(self):
        rank = dist.get_rank()
        yield (torch.full((64, 1), 0.0) if rank == 0 else torch.full((36, 1), 1.0),)

    def __len__(self):
        return 1


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        return (self.w - 1).pow(2).sum()

    def validation_step(self, batch, batch_idx):
        return {"positive": batch[0].mean()}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    trainer = cardcage.Trainer(
        distributed_backend="ddp_spawn", num_processes=2, max_epochs=1, progress_bar=False
    )
    train = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.zeros(4, 1)), batch_size=1
    )
    trainer.fit(Model(), train, Split())
    print(json.dumps(trainer.logged_metrics))
"""


@pytest.mark.slow
def test_under_ddp_spawn_the_mean_is_the_mean_over_every_ranks_samples(tmp_path: Path) -> None:
    script = tmp_path / "split.py"
    script.write_text(textwrap.dedent(SCRIPT))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads(done.stdout.strip().splitlines()[-1])
    # one process over the 100 samples: 36 / 100 (an unweighted mean of ranks gives 0.5)
    assert metrics["val_positive"] == pytest.approx(0.36, abs=1e-12)


@pytest.mark.parametrize("backend", ["ddp_spawn", "ddp"])
def test_before_any_fit_the_caller_evaluates_alone(backend: str) -> None:
    """validate/test/predict before fit under a backend whose fit starts the processes: the
    caller evaluates every sample itself (no process group, no process started), instead of
    failing on a process group it cannot join."""
    trainer = cardcage.Trainer(distributed_backend=backend, num_processes=2, progress_bar=False)
    metrics = trainer.validate(Counting(), uneven())[0]
    assert metrics["val_positive"] == pytest.approx(0.36, abs=1e-12)
    assert trainer.test(Counting(), uneven())[0]["test_loss"] == pytest.approx(0.36, abs=1e-12)
    assert not torch.distributed.is_initialized()
