"""The loop under ``ddp_spawn`` with two real processes (gloo): ``sync_dist=True`` means
weighted over every rank's samples, and a stop asked by one rank is agreed by all."""

from __future__ import annotations

import csv
import importlib
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage
from cardcage.loggers import CSVLogger

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow


@pytest.fixture
def ddp_models(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The workers' module, importable by name here and in the spawned workers."""
    monkeypatch.syspath_prepend(str(HERE))
    return importlib.import_module("ddp_models")


def spawn_trainer(**flags: Any) -> cardcage.Trainer:
    return cardcage.Trainer(
        distributed_backend="ddp_spawn", num_processes=2, progress_bar=False, **flags
    )


UNEVEN = torch.tensor([[1.0], [3.0], [0.0], [0.0], [0.0], [2.0], [2.0], [2.0]])
PLAN = {0: [[0], [1]], 1: [[2, 3, 4], [5, 6, 7]]}


def uneven_fit(ddp_models: ModuleType, **flags: Any) -> cardcage.Trainer:
    """Rank 0 trains on batches [1] and [3]; rank 1 on [0, 0, 0] and [2, 2, 2]; the same
    batches validate. The mean of all 8 samples is 10 / 8 = 1.25 (the mean of the ranks'
    means, or of the batch means, is 1.5); rank 0's own mean is 2.0."""

    def loader() -> DataLoader[Any]:
        return DataLoader(TensorDataset(UNEVEN), batch_sampler=ddp_models.PerRankBatches(PLAN))

    trainer = spawn_trainer(max_epochs=1, replace_sampler_ddp=False, **flags)
    trainer.fit(ddp_models.SyncLog(), loader(), loader())
    return trainer


def test_sync_dist_means_are_weighted_over_every_ranks_samples(ddp_models: ModuleType) -> None:
    trainer = uneven_fit(ddp_models)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert metrics["t"] == pytest.approx(1.25, abs=1e-6), metrics
    assert metrics["v"] == pytest.approx(1.25, abs=1e-6), metrics
    assert metrics["t_local"] == pytest.approx(2.0, abs=1e-6), metrics  # rank 0's, unsynced
    assert metrics["v_local"] == pytest.approx(2.0, abs=1e-6), metrics
    assert metrics["s"] == pytest.approx((3.0 + 2.0) / 2, abs=1e-6), metrics  # last step's
    assert trainer.logged_metrics["t"] == pytest.approx(1.25, abs=1e-6)
    assert trainer.logged_metrics["v"] == pytest.approx(1.25, abs=1e-6)


def test_rank_0_alone_writes_the_csv_file_with_the_synced_values(
    ddp_models: ModuleType, tmp_path: Path
) -> None:
    uneven_fit(ddp_models, logger=CSVLogger(tmp_path))
    assert [p.name for p in (tmp_path / "logs").iterdir()] == ["version_0"]
    with open(tmp_path / "logs" / "version_0" / "metrics.csv", newline="") as file:
        (row,) = list(csv.DictReader(file))  # the epoch's values and validation, at step 1
    assert int(row["step"]) == 1
    assert float(row["t"]) == pytest.approx(1.25, abs=1e-6)
    assert float(row["v"]) == pytest.approx(1.25, abs=1e-6)
    assert float(row["t_local"]) == pytest.approx(2.0, abs=1e-6)


def test_a_stop_asked_by_one_rank_stops_every_rank_at_the_same_step(
    ddp_models: ModuleType, tmp_path: Path
) -> None:
    """Only rank 1 sets should_stop, at the end of epoch 0 of 3: both ranks end that epoch
    and stop, at global_step 4 (16 samples, 8 a rank, batches of 2), and so does the
    caller's trainer."""
    x = torch.randn(16, 2, generator=torch.Generator().manual_seed(0))
    callback = ddp_models.StopOnOneRank(str(tmp_path))
    trainer = spawn_trainer(max_epochs=3, callbacks=[callback])
    trainer.fit(ddp_models.Small(), DataLoader(TensorDataset(x), batch_size=2))
    records = {r: json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)}
    assert [records[r]["global_step"] for r in (0, 1)] == [4, 4], records
    assert [records[r]["ended"] for r in (0, 1)] == [[0], [0]], records
    assert records[0]["current_epoch"] == records[1]["current_epoch"]
    assert trainer.global_step == 4
