"""ModelCheckpoint and EarlyStopping under ``ddp_spawn``: ``python callbacks_job.py OUT
SCENARIO``.

``disagree``: each rank logs its own ``val_loss`` (no ``sync_dist``) from a script:
rank 0's keeps improving, rank 1's stops improving after epoch 1, so with patience 2 only
rank 1 asks to stop, at epoch 3. Each rank writes ``OUT/rank<R>.json`` at the end of
training (the epochs it trained, its ``global_step``, its callbacks' state); the caller
writes ``OUT/caller.json`` after ``fit``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage
from cardcage.callbacks import EarlyStopping, ModelCheckpoint

#: val_loss by rank, then epoch.
SCRIPT = {
    0: [5.0, 4.0, 3.0, 2.0, 1.0, 0.5, 0.4, 0.3],
    1: [5.0, 4.0, 6.0, 7.0, 1.0, 0.5, 0.4, 0.3],
}


class Scripted(cardcage.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(2, 1)
        self.epochs: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss: torch.Tensor = self.layer(x).pow(2).mean()
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        value = SCRIPT[self.global_rank][self.current_epoch]
        self.log("val_loss", torch.tensor(value))  # this rank's own: no sync_dist

    def on_train_epoch_start(self) -> None:
        self.epochs.append(self.current_epoch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def plain(state: dict[str, Any]) -> dict[str, Any]:
    """A callback state as JSON: tensors as floats."""

    def value(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return float(v)
        if isinstance(v, dict):
            return {k: value(x) for k, x in v.items()}
        return v

    plain_state: dict[str, Any] = value(state)
    return plain_state


class Record(cardcage.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        check, stopper = trainer.checkpoint_callback, trainer.early_stopping_callback
        record = {
            "epochs": pl_module.epochs,
            "global_step": trainer.global_step,
            "stopped_epoch": stopper.stopped_epoch,
            "checkpoint": plain(check.on_save_checkpoint(trainer, pl_module)),
        }
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def main(argv: list[str]) -> int:
    out, scenario = Path(argv[0]), argv[1]
    assert scenario == "disagree", scenario
    check = ModelCheckpoint(filename="{epoch}", monitor="val_loss", save_top_k=2)
    trainer = cardcage.Trainer(
        distributed_backend="ddp_spawn",
        num_processes=2,
        max_epochs=len(SCRIPT[0]),
        default_root_dir=str(out.parent / "root"),
        logger=False,
        progress_bar=False,
        callbacks=[check, EarlyStopping("val_loss", patience=2), Record(out)],
    )
    data = TensorDataset(torch.randn(8, 2))
    trainer.fit(Scripted(), DataLoader(data, batch_size=2), DataLoader(data, batch_size=2))
    caller = trainer.checkpoint_callback
    record = {
        "global_step": trainer.global_step,
        "dirpath": caller.dirpath,
        "best_model_path": caller.best_model_path,
        "checkpoint": plain(caller.on_save_checkpoint(trainer, None)),
    }
    (out / "caller.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
