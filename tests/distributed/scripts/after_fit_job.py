"""A 2-process fit, then ``trainer.test`` on the same Trainer: ``python after_fit_job.py OUT
BACKEND`` (``ddp_spawn``, or ``ddp``: this script relaunched as rank 1).

The Trainer logs to a CSV logger (``ROOT/logs``) and, when ``tensorboard`` is installed, a
TensorBoard logger (``ROOT/tb``), ``ROOT`` being ``OUT/root`` (``default_root_dir``). On
each rank, at the end of fit, a callback records ``trainer.logger`` (its class, version,
folders) in ``OUT/info-rank<R>.json`` and, on every rank but 0, writes through it
(``log_metrics``, ``log_hyperparams``, ``experiment.add_scalar``): none of it may reach a
file. Every process that ran the script then writes ``OUT/result-rank<R>.json``: its pid,
the trained weights, the files under ``ROOT`` and what its ``hparams.yaml`` files hold,
``metrics.csv``'s rows after fit and after ``test``, and what ``test`` returned.

Imported, it offers :func:`test_data`, the data ``test`` ran on.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage
from cardcage.callbacks import Callback
from cardcage.loggers import CSVLogger, Logger, TensorBoardLogger

FEATURES = 3
PROBE = "written_by_rank_1"


def data(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=generator)
    y = x @ torch.arange(1.0, FEATURES + 1).unsqueeze(1)
    return TensorDataset(x, y + 0.1 * torch.randn(samples, 1, generator=generator))


def test_data() -> TensorDataset:
    return data(16, 3)


class Model(cardcage.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(FEATURES, 1)
        self.hparams = {"lr": 0.1, "features": FEATURES}

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RecordLogger(Callback):
    """At the end of fit, what ``trainer.logger`` is on this rank; off rank 0, writes
    through it (all of which must be dropped)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        logger = trainer.logger
        rank = trainer.global_rank
        seen = {
            "rank": rank,
            "pid": os.getpid(),
            "class": type(logger).__name__,
            "version": str(logger.version),
            "log_dirs": [each.log_dir for each in logger],
        }
        if rank != 0:
            logger.log_metrics({PROBE: 1.0}, step=0)
            logger.log_hyperparams({PROBE: 1})
            for each in logger:  # a SummaryWriter's method (the dummy's takes any name)
                if hasattr(each.experiment, "add_scalar"):
                    each.experiment.add_scalar(PROBE, 1.0, 0)
            logger.save()
            logger.finalize("success")
        Path(self.out, f"info-rank{rank}.json").write_text(json.dumps(seen))


def rows(root: Path) -> list[dict[str, str]]:
    path = root / "logs" / "version_0" / "metrics.csv"
    if not path.exists():
        return []
    with path.open(newline="") as file:
        return list(csv.DictReader(file))


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def main(out: Path, backend: str) -> None:
    root = out / "root"
    loggers: list[Logger] = [CSVLogger(root)]
    if importlib.util.find_spec("tensorboard") is not None:
        loggers.append(TensorBoardLogger(root, name="tb"))
    trainer = cardcage.Trainer(
        distributed_backend=backend,
        num_processes=2,
        max_epochs=1,
        progress_bar=False,
        default_root_dir=root,
        logger=loggers,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        callbacks=[RecordLogger(str(out))],
    )
    model = Model()
    trainer.fit(
        model,
        DataLoader(data(32, 1), batch_size=4),
        DataLoader(data(16, 2), batch_size=4),
    )
    rank = trainer.global_rank
    fit_rows, fit_files = rows(root), files(root)
    results = trainer.test(model, DataLoader(test_data(), batch_size=4))
    result = {
        "rank": rank,
        "pid": os.getpid(),
        "tensorboard": len(loggers) == 2,
        "weights": {k: v.tolist() for k, v in model.net.state_dict().items()},
        "fit_rows": fit_rows,
        "fit_files": fit_files,
        "test": [dict(r) for r in results],
        "test_rows": rows(root),
        "test_files": files(root),
        "hparams": [(root / f).read_text() for f in files(root) if f.endswith("hparams.yaml")],
    }
    (out / f"result-rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
