"""ModelCheckpoint and EarlyStopping in real fits with ``cardcage.Trainer`` on the cpu
backend: files on disk, when training stops, what the caller sees after ``fit``, and a
resume that continues both callbacks' bookkeeping. The validation metric is scripted per
epoch by the model, so every expected file and stop is known in advance.

The two-process tests run ``callbacks_job.py`` (next to this file) under ``ddp_spawn``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage
from cardcage.callbacks import CALLBACK_HOOKS, EarlyStopping, ModelCheckpoint
from cardcage.testing.harness import Harness

JOB = Path(__file__).with_name("callbacks_job.py")
BATCHES = 2  # training batches per epoch: global_step grows by 2 an epoch


class Scripted(cardcage.Module):
    """Validation logs ``val_loss = values[current_epoch]``; records the epochs trained."""

    def __init__(self, values: list[float]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(2, 1)
        self.values = values
        self.epochs: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss: torch.Tensor = self.layer(x).pow(2).mean()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", torch.tensor(self.values[self.current_epoch]))

    def on_train_epoch_start(self) -> None:
        self.epochs.append(self.current_epoch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader(samples: int) -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.randn(samples, 2)), batch_size=2)


def fit(model: Scripted, root: Path, callbacks: list[Any], **flags: Any) -> cardcage.Trainer:
    flags = {"max_epochs": len(model.values), "logger": False, **flags}
    trainer = cardcage.Trainer(
        default_root_dir=str(root), progress_bar=False, callbacks=callbacks, **flags
    )
    trainer.fit(model, loader(2 * BATCHES), loader(2))
    return trainer


def files(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir()) if folder.exists() else []


def test_the_best_k_stay_on_disk_with_last(tmp_path: Path) -> None:
    values = [5.0, 3.0, 4.0, 1.0, 2.0]
    check = ModelCheckpoint(filename="{epoch}-{val_loss:.1f}", monitor="val_loss", save_top_k=2)
    check.save_last = True
    trainer = fit(Scripted(values), tmp_path, [check])
    folder = tmp_path / "checkpoints"
    assert files(folder) == ["epoch=3-val_loss=1.0.ckpt", "epoch=4-val_loss=2.0.ckpt", "last.ckpt"]
    assert trainer.checkpoint_callback is check
    assert check.best_model_path == str(folder / "epoch=3-val_loss=1.0.ckpt")
    assert check.best_model_score is not None and float(check.best_model_score) == 1.0
    assert Path(check.kth_best_model_path).name == "epoch=4-val_loss=2.0.ckpt"
    assert check.last_model_path == str(folder / "last.ckpt")

    best = torch.load(check.best_model_path, weights_only=True)
    assert (best["global_step"], best["epoch"]) == (4 * BATCHES, 4)  # epoch 3's end
    state = best["callbacks"][check.state_key]
    # the state names its files relative to its folder (a run that loads it places them)
    assert state["dirpath"] == str(folder)
    assert os.path.join(folder, state["best_model_path"]) == check.best_model_path
    last = torch.load(check.last_model_path, weights_only=True)
    assert last["global_step"] == best["global_step"] + BATCHES


def test_every_n_epochs_without_a_monitor_keeps_all_when_asked(tmp_path: Path) -> None:
    every = ModelCheckpoint(tmp_path / "all", save_top_k=-1, every_n_epochs=2)
    latest = ModelCheckpoint(tmp_path / "one")
    fit(Scripted([1.0] * 5), tmp_path, [every, latest])
    assert files(tmp_path / "all") == [
        f"epoch=1-step={2 * BATCHES}.ckpt",
        f"epoch=3-step={4 * BATCHES}.ckpt",
    ]
    assert files(tmp_path / "one") == [f"epoch=4-step={5 * BATCHES}.ckpt"]
    assert latest.best_model_score is None


def test_early_stopping_stops_at_the_epoch_patience_runs_out(tmp_path: Path) -> None:
    model = Scripted([3.0, 2.0, 2.5, 2.4, 1.0, 0.5, 0.4, 0.3])
    stopper = EarlyStopping("val_loss", patience=2)
    trainer = fit(model, tmp_path, [stopper])
    assert model.epochs == [0, 1, 2, 3]
    assert (stopper.stopped_epoch, stopper.wait_count, float(stopper.best_score)) == (3, 2, 2.0)
    assert trainer.global_step == 4 * BATCHES
    assert trainer.early_stopping_callback is stopper


def test_min_epochs_outlasts_the_request(tmp_path: Path) -> None:
    """The request made at epoch 1 is ignored until min_epochs; the callback asks again."""
    model = Scripted([1.0] * 8)
    stopper = EarlyStopping("val_loss", patience=1)
    fit(model, tmp_path, [stopper], min_epochs=4)
    assert model.epochs == [0, 1, 2, 3]
    assert stopper.stopped_epoch == 3


def test_only_validated_epochs_count(tmp_path: Path) -> None:
    """check_val_every_n_epoch=2: epochs 1, 3, 5 validate; EarlyStopping counts those, and
    ModelCheckpoint ranks only those (epoch 0 has no val_loss yet: no error)."""
    nan = float("nan")  # never read: those epochs do not validate
    model = Scripted([nan, 3.0, nan, 4.0, nan, 5.0, nan, 1.0])
    stopper = EarlyStopping("val_loss", patience=2)
    check = ModelCheckpoint(filename="{epoch}", monitor="val_loss", save_top_k=-1)
    fit(model, tmp_path, [check, stopper], check_val_every_n_epoch=2)
    assert model.epochs == [0, 1, 2, 3, 4, 5]
    assert stopper.stopped_epoch == 5
    assert files(tmp_path / "checkpoints") == ["epoch=1.ckpt", "epoch=3.ckpt", "epoch=5.ckpt"]


def test_a_missing_monitor_fails_the_fit_naming_the_metrics(tmp_path: Path) -> None:
    with pytest.raises(cardcage.MisconfigurationError, match=r"'val_acc'.*val_loss"):
        fit(Scripted([1.0]), tmp_path, [ModelCheckpoint(monitor="val_acc")])
    with pytest.raises(cardcage.MisconfigurationError, match=r"'val_acc'.*val_loss"):
        fit(Scripted([1.0]), tmp_path, [EarlyStopping("val_acc")])


def test_fast_dev_run_writes_no_checkpoint(tmp_path: Path) -> None:
    fit(Scripted([1.0]), tmp_path, [ModelCheckpoint(save_last=True)], fast_dev_run=True)
    assert not (tmp_path / "checkpoints").exists()


def test_without_a_folder_the_loggers_is_used(tmp_path: Path) -> None:
    check = ModelCheckpoint()
    fit(Scripted([1.0]), tmp_path, [check], logger=True)
    folder = tmp_path / "logs" / "version_0" / "checkpoints"
    assert files(folder) == [f"epoch=0-step={BATCHES}.ckpt"]
    assert check.dirpath == str(folder)


def test_a_resume_continues_both_callbacks(tmp_path: Path) -> None:
    """Run 1 (epochs 0-2) keeps epochs 1 and 2 and has waited 1 epoch; run 2 resumes from
    last.ckpt with new callback objects: epoch 3 pushes out run 1's epoch 2 file (and epoch
    4 epoch 3's), and patience 3 runs out at epoch 4. Fresh state would leave run 1's files
    alone and stop later."""
    values = [3.0, 2.0, 2.5, 2.2, 2.1, 2.05, 2.04, 2.03]

    def callbacks() -> list[Any]:
        check = ModelCheckpoint(filename="{epoch}", monitor="val_loss", save_top_k=2)
        check.save_last = True
        return [check, EarlyStopping("val_loss", patience=3)]

    first = fit(Scripted(values), tmp_path, callbacks(), max_epochs=3)
    folder = tmp_path / "checkpoints"
    assert files(folder) == ["epoch=1.ckpt", "epoch=2.ckpt", "last.ckpt"]
    assert first.early_stopping_callback.wait_count == 1
    # saved after EarlyStopping's epoch-2 check, though the checkpoint is listed first
    saved = torch.load(folder / "last.ckpt", weights_only=True)["callbacks"]
    assert saved["EarlyStopping"]["wait_count"] == 1

    model = Scripted(values)
    resumed = callbacks()
    second = fit(model, tmp_path, resumed, resume_from_checkpoint=str(folder / "last.ckpt"))
    check, stopper = resumed
    assert model.epochs == [3, 4]
    assert (stopper.stopped_epoch, stopper.wait_count, float(stopper.best_score)) == (4, 3, 2.0)
    assert files(folder) == ["epoch=1.ckpt", "epoch=4.ckpt", "last.ckpt"]
    assert check.best_model_path == str(folder / "epoch=1.ckpt")
    assert set(check.best_k_models) == {str(folder / "epoch=1.ckpt"), str(folder / "epoch=4.ckpt")}
    assert second.checkpoint_callback is check


# -- two processes ---------------------------------------------------------------------------


def run_job(root: Path, scenario: str) -> dict[str, Any]:
    """Run ``callbacks_job.py`` (``ddp_spawn``, 2 processes); what each rank and the caller
    wrote. No process of the job may outlive it."""
    harness = Harness(root)
    out = root / "out"
    try:
        # Ranks that took different save decisions would wait in the collective for ever
        harness.start([sys.executable, str(JOB), str(out), scenario]).check(timeout=180)
        harness.assert_no_leftovers()
    finally:
        harness.cleanup()
    return {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")}


@pytest.mark.slow
def test_ranks_that_disagree_stop_together_and_save_as_rank_0_decides(tmp_path: Path) -> None:
    """Each rank logs its own val_loss without sync_dist: rank 0's keeps improving, rank 1's
    runs out of patience at epoch 3. Every rank stops after epoch 3 at the same
    global_step; the checkpoints kept are those rank 0's values rank best (epochs 2 and 3;
    rank 1's would be 0 and 1), the same bookkeeping on both ranks and in the caller."""
    seen = run_job(tmp_path, "disagree")
    rank0, rank1, caller = seen["rank0"], seen["rank1"], seen["caller"]
    assert rank0["epochs"] == rank1["epochs"] == [0, 1, 2, 3]
    assert rank0["global_step"] == rank1["global_step"] == caller["global_step"]
    assert rank1["stopped_epoch"] == 3
    assert rank0["stopped_epoch"] == 0  # rank 0 never asked
    folder = Path(caller["dirpath"])
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=2.ckpt", "epoch=3.ckpt"]
    assert rank0["checkpoint"] == rank1["checkpoint"]
    assert caller["checkpoint"]["best_model_path"] == "epoch=3.ckpt"  # relative to dirpath
    assert caller["best_model_path"] == str(folder / "epoch=3.ckpt")
    assert caller["checkpoint"]["best_model_score"] == 2.0


class Recorder(cardcage.Callback):
    """Records the name of every hook of CALLBACK_HOOKS the loop calls on it."""

    def __init__(self) -> None:
        self.called: list[str] = []


def _recording(name: str) -> Any:
    def hook(self: Recorder, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.called.append(name)

    return hook


for _name in CALLBACK_HOOKS:
    setattr(Recorder, _name, _recording(_name))


class WithTestStep(Scripted):
    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss: torch.Tensor = self.layer(x).pow(2).mean()
        return loss


def test_the_loop_calls_every_hook_callback_hooks_names(tmp_path: Path) -> None:
    """A fit with a sanity check and validation, then a test, calls each hook of
    CALLBACK_HOOKS (the list the loop's dispatch relies on), and setup before on_fit_start."""
    recorder = Recorder()
    trainer = fit(WithTestStep([1.0, 1.0]), tmp_path, [recorder], num_sanity_val_steps=1)
    trainer.test(dataloaders=loader(2))
    assert set(recorder.called) == set(CALLBACK_HOOKS)
    assert recorder.called[:2] == ["setup", "on_fit_start"]
