"""ModelCheckpoint's decisions, driven through its hook with a trainer as plain data: file
names, the top k kept on disk, when it saves, its state, and the plan rank 0 broadcasts."""

from __future__ import annotations

import math
import os
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from cardcage import MisconfigurationError
from cardcage.callbacks import ModelCheckpoint

EpochEnd = Callable[..., None]


def names(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir()) if folder.exists() else []


# -- file names ------------------------------------------------------------------------------


def test_names_insert_the_metric_name_like_lightning() -> None:
    check = ModelCheckpoint(filename="{epoch}-{val_loss:.2f}")
    assert check.format_checkpoint_name(3, 40, {"val_loss": torch.tensor(0.1234)}) == (
        "epoch=3-val_loss=0.12.ckpt"
    )
    assert ModelCheckpoint().format_checkpoint_name(3, 40, {}) == "epoch=3-step=40.ckpt"
    assert check.format_checkpoint_name(0, 1, {"val_loss": 1.0}, ver=0) == (
        "epoch=0-val_loss=1.00-v0.ckpt"
    )


def test_a_name_spelled_out_is_not_doubled() -> None:
    check = ModelCheckpoint(filename="epoch={epoch}-acc{acc:.1f}")
    assert check.format_checkpoint_name(2, 5, {"acc": 0.5}) == "epoch=2-accacc=0.5.ckpt"
    check = ModelCheckpoint(filename="e{epoch}-loss={loss:.3f}")
    assert check.format_checkpoint_name(2, 5, {"loss": 0.5}) == "eepoch=2-loss=0.500.ckpt"


def test_a_metric_missing_from_the_name_is_zero_with_a_warning() -> None:
    check = ModelCheckpoint(filename="{epoch}-{val_acc:.2f}")
    with pytest.warns(UserWarning, match=r"'val_acc' is not in .*available: loss"):
        name = check.format_checkpoint_name(1, 2, {"loss": 1.0})
    assert name == "epoch=1-val_acc=0.00.ckpt"


# -- what is kept ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "scores", "kept", "best"),
    [
        ("min", [5, 3, 4, 1, 2], [3, 4], 3),  # epochs 3 (1.0) and 4 (2.0) are the best two
        ("max", [5, 3, 4, 1, 2], [0, 2], 0),
    ],
)
def test_the_top_k_files_on_disk_follow_the_monitored_value(
    make_trainer: Callable[..., Any],
    epoch_end: EpochEnd,
    tmp_path: Path,
    mode: str,
    scores: list[float],
    kept: list[int],
    best: int,
) -> None:
    check = ModelCheckpoint(tmp_path / "ckpt", "{epoch}", "val_loss", mode, save_top_k=2)
    trainer = make_trainer()
    for epoch, score in enumerate(scores):
        epoch_end(check, trainer, epoch, val_loss=score)
    assert names(tmp_path / "ckpt") == [f"epoch={e}.ckpt" for e in kept]
    assert check.best_model_path == str(tmp_path / "ckpt" / f"epoch={best}.ckpt")
    assert check.best_model_score is not None
    assert float(check.best_model_score) == scores[best]
    assert {Path(p).name: float(s) for p, s in check.best_k_models.items()} == {
        f"epoch={e}.ckpt": scores[e] for e in kept
    }
    worst = (
        max(kept, key=lambda e: scores[e]) if mode == "min" else min(kept, key=scores.__getitem__)
    )
    assert Path(check.kth_best_model_path).name == f"epoch={worst}.ckpt"


def test_a_tie_keeps_the_earlier_checkpoint(
    make_trainer: Callable[..., Any], epoch_end: EpochEnd, tmp_path: Path
) -> None:
    check = ModelCheckpoint(tmp_path, "{epoch}", "loss", save_top_k=1)
    trainer = make_trainer()
    for epoch in range(3):
        epoch_end(check, trainer, epoch, loss=1.0)
    assert names(tmp_path) == ["epoch=0.ckpt"]
    assert trainer.saved == [str(tmp_path / "epoch=0.ckpt")]


def test_nan_ranks_worst(
    make_trainer: Callable[..., Any], epoch_end: EpochEnd, tmp_path: Path
) -> None:
    check = ModelCheckpoint(tmp_path, "{epoch}", "loss", save_top_k=2)
    trainer = make_trainer()
    for epoch, score in enumerate([math.nan, 2.0, 3.0]):
        epoch_end(check, trainer, epoch, loss=score)
    assert names(tmp_path) == ["epoch=1.ckpt", "epoch=2.ckpt"]


def test_save_top_k_minus_one_keeps_all_and_zero_keeps_only_last(
    make_trainer: Callable[..., Any], epoch_end: EpochEnd, tmp_path: Path
) -> None:
    every = ModelCheckpoint(tmp_path / "all", "{epoch}", "loss", save_top_k=-1)
    last_only = ModelCheckpoint(tmp_path / "last", "{epoch}", "loss", save_top_k=0, save_last=True)
    trainer = make_trainer()
    for epoch, score in enumerate([3.0, 1.0, 2.0]):
        epoch_end(every, trainer, epoch, loss=score)
        epoch_end(last_only, trainer, epoch, loss=score)
    assert names(tmp_path / "all") == ["epoch=0.ckpt", "epoch=1.ckpt", "epoch=2.ckpt"]
    assert names(tmp_path / "last") == ["last.ckpt"]
    assert last_only.best_model_path == ""
    assert last_only.last_model_path == str(tmp_path / "last" / "last.ckpt")


def test_without_a_monitor_each_save_replaces_the_previous(
    make_trainer: Callable[..., Any], epoch_end: EpochEnd, tmp_path: Path
) -> None:
    latest = ModelCheckpoint(tmp_path / "one", save_last=True)
    every = ModelCheckpoint(tmp_path / "all", save_top_k=-1)
    trainer = make_trainer()
    for epoch in range(3):
        epoch_end(latest, trainer, epoch, loss=1.0)
        epoch_end(every, trainer, epoch, loss=1.0)
    assert names(tmp_path / "one") == ["epoch=2-step=30.ckpt", "last.ckpt"]
    assert latest.best_model_path == str(tmp_path / "one" / "epoch=2-step=30.ckpt")
    assert latest.best_model_score is None
    assert names(tmp_path / "all") == [f"epoch={e}-step={10 * (e + 1)}.ckpt" for e in range(3)]


def test_a_name_taken_on_disk_gets_a_version(
    make_trainer: Callable[..., Any], epoch_end: EpochEnd, tmp_path: Path
) -> None:
    (tmp_path / "epoch=0.ckpt").write_bytes(b"an earlier run's")
    check = ModelCheckpoint(tmp_path, "{epoch}", save_top_k=-1)
    epoch_end(check, make_trainer(), 0)
    assert (tmp_path / "epoch=0.ckpt").read_bytes() == b"an earlier run's"
    assert check.best_model_path == str(tmp_path / "epoch=0-v0.ckpt")


# -- when it saves ---------------------------------------------------------------------------


def test_every_n_epochs(
    make_trainer: Callable[..., Any], epoch_end: EpochEnd, tmp_path: Path
) -> None:
    check = ModelCheckpoint(tmp_path, "{epoch}", save_top_k=-1, every_n_epochs=2)
    trainer = make_trainer()
    for epoch in range(5):
        epoch_end(check, trainer, epoch)
    assert names(tmp_path) == ["epoch=1.ckpt", "epoch=3.ckpt"]


def test_nothing_while_sanity_checking_in_fast_dev_run_or_without_new_steps(
    make_trainer: Callable[..., Any], epoch_end: EpochEnd, tmp_path: Path
) -> None:
    check = ModelCheckpoint(tmp_path, save_last=True)
    trainer = make_trainer()
    trainer.sanity_checking = True
    epoch_end(check, trainer, 0)
    trainer.sanity_checking = False
    trainer.flags.fast_dev_run = 1
    epoch_end(check, trainer, 0)
    assert trainer.saved == []
    trainer.flags.fast_dev_run = False
    epoch_end(check, trainer, 0)
    check.on_epoch_end(trainer, None)  # the same global_step: nothing new to save
    assert len(trainer.saved) == 2  # one top-k file, one last.ckpt


def test_a_missing_monitor_raises_naming_it_and_the_available_ones(
    make_trainer: Callable[..., Any], epoch_end: EpochEnd, tmp_path: Path
) -> None:
    check = ModelCheckpoint(tmp_path, monitor="val_los")
    with pytest.raises(MisconfigurationError, match=r"'val_los'.*available: train_loss, val_loss"):
        epoch_end(check, make_trainer(), 0, val_loss=1.0, train_loss=2.0)


def test_epochs_between_validations_keep_no_stale_score(
    make_trainer: Callable[..., Any], epoch_end: EpochEnd, tmp_path: Path
) -> None:
    """With check_val_every_n_epoch=2, an epoch that did not validate is not ranked by the
    earlier validation's value, and a validation metric not there yet is no error."""
    check = ModelCheckpoint(tmp_path, "{epoch}", "val_loss", save_top_k=-1, save_last=True)
    trainer = make_trainer()
    trainer.flags.check_val_every_n_epoch = 2
    trainer.validated_this_epoch = False
    epoch_end(check, trainer, 0, train_loss=3.0)
    trainer.validated_this_epoch = True
    epoch_end(check, trainer, 1, train_loss=2.0, val_loss=1.0)
    trainer.validated_this_epoch = False
    epoch_end(check, trainer, 2, train_loss=1.0, val_loss=1.0)
    assert names(tmp_path) == ["epoch=1.ckpt", "last.ckpt"]


def test_no_validation_at_all_judges_every_epoch(
    make_trainer: Callable[..., Any], epoch_end: EpochEnd, tmp_path: Path
) -> None:
    """An epoch that was due to validate and did not: the fit has no validation, so a
    missing monitor is a mistake, not a metric still to come."""
    check = ModelCheckpoint(tmp_path, monitor="val_loss")
    trainer = make_trainer()
    trainer.validated_this_epoch = False
    with pytest.raises(MisconfigurationError, match="'val_loss'"):
        epoch_end(check, trainer, 0, train_loss=1.0)


# -- where files go --------------------------------------------------------------------------


def test_the_folder_is_the_loggers_else_the_root_dir_else_cwd(
    make_trainer: Callable[..., Any],
    epoch_end: EpochEnd,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trainer = make_trainer()
    trainer.logger = types.SimpleNamespace(log_dir=str(tmp_path / "logs" / "version_0"))
    check = ModelCheckpoint()
    epoch_end(check, trainer, 0)
    assert check.dirpath == str(tmp_path / "logs" / "version_0" / "checkpoints")
    assert Path(check.best_model_path).parent == tmp_path / "logs" / "version_0" / "checkpoints"

    trainer = make_trainer()
    check = ModelCheckpoint()
    epoch_end(check, trainer, 0)
    assert check.dirpath == str(tmp_path / "checkpoints")

    monkeypatch.chdir(tmp_path / "logs")
    trainer.default_root_dir = None
    check = ModelCheckpoint()
    epoch_end(check, trainer, 0)
    assert check.dirpath == str(tmp_path / "logs" / "checkpoints")


# -- the rank-0 decision ---------------------------------------------------------------------


def test_every_rank_follows_rank_0s_plan(
    make_trainer: Callable[..., Any], epoch_end: EpochEnd, tmp_path: Path
) -> None:
    """Rank 1 sees other values (a metric logged without sync_dist) and no folder of its
    own; it saves what rank 0 decided, deletes nothing, and keeps the same bookkeeping."""
    plans: list[Any] = []

    def rank_0_broadcast(obj: Any, src: int = 0) -> Any:
        plans.append(obj)
        return obj

    rank0, rank1 = make_trainer(), make_trainer()
    rank0.accelerator.broadcast = rank_0_broadcast
    rank1.is_global_zero, rank1.global_rank = False, 1
    rank1.accelerator.broadcast = lambda obj, src=0: (
        (obj is None and plans[-1]) or pytest.fail("a rank other than 0 offered a plan")
    )
    rank1.save_checkpoint = rank1.saved.append  # rank 0 writes
    first = ModelCheckpoint(tmp_path, "{epoch}", "loss", save_top_k=1)
    second = ModelCheckpoint(tmp_path, "{epoch}", "loss", save_top_k=1)
    for epoch, (score0, score1) in enumerate([(2.0, 9.0), (1.0, 0.5), (3.0, 0.1)]):
        epoch_end(first, rank0, epoch, loss=score0)
        epoch_end(second, rank1, epoch, loss=score1)
    assert rank1.saved == rank0.saved == [str(tmp_path / f"epoch={e}.ckpt") for e in (0, 1)]
    assert names(tmp_path) == ["epoch=1.ckpt"]
    assert second.on_save_checkpoint(rank1, None) == first.on_save_checkpoint(rank0, None)
    # the plan crosses processes by any backend's broadcast: plain values, no tensors
    assert all(plain(plan) for plan in plans)


def plain(value: Any) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(plain(v) for v in value)
    return value is None or isinstance(value, str | int | float)


def test_a_missing_monitor_raises_on_every_rank(
    make_trainer: Callable[..., Any], epoch_end: EpochEnd, tmp_path: Path
) -> None:
    """Rank 0 finds the monitor missing; a rank that has it raises the same error rather
    than entering a save the others never reach."""
    plans: list[Any] = []
    rank0, rank1 = make_trainer(), make_trainer()

    def rank_0_broadcast(obj: Any, src: int = 0) -> Any:
        plans.append(obj)
        return obj

    rank0.accelerator.broadcast = rank_0_broadcast
    rank1.is_global_zero = False
    rank1.accelerator.broadcast = lambda obj, src=0: plans[-1]
    with pytest.raises(MisconfigurationError, match="'loss'"):
        epoch_end(ModelCheckpoint(tmp_path, monitor="loss"), rank0, 0, other=1.0)
    with pytest.raises(MisconfigurationError, match="'loss'"):
        epoch_end(ModelCheckpoint(tmp_path, monitor="loss"), rank1, 0, loss=1.0)
    assert rank1.saved == []


# -- state -----------------------------------------------------------------------------------


def test_the_state_comes_back_and_the_top_k_continues(
    make_trainer: Callable[..., Any], epoch_end: EpochEnd, tmp_path: Path
) -> None:
    before = ModelCheckpoint(tmp_path, "{epoch}", "loss", save_top_k=2, save_last=True)
    trainer = make_trainer()
    for epoch, score in enumerate([3.0, 2.0]):
        epoch_end(before, trainer, epoch, loss=score)
    state = before.on_save_checkpoint(trainer, None)

    # the state's names are relative to its folder: this run's own folder places them
    assert state["best_k_models"].keys() == {"epoch=0.ckpt", "epoch=1.ckpt"}
    after = ModelCheckpoint(tmp_path, "{epoch}", "loss", save_top_k=2, save_last=True)
    after.on_load_checkpoint(state)
    assert (after.dirpath, after.best_model_path, after.last_model_path) == (
        str(tmp_path),
        before.best_model_path,
        before.last_model_path,
    )
    assert after.best_k_models == before.best_k_models
    epoch_end(after, make_trainer(), 2, loss=1.0)  # better than epoch 0: it goes
    assert names(tmp_path) == ["epoch=1.ckpt", "epoch=2.ckpt", "last.ckpt"]
    assert float(after.best_model_score or 0) == 1.0


def test_a_resume_with_another_monitor_or_folder_starts_the_top_k_afresh(
    make_trainer: Callable[..., Any], epoch_end: EpochEnd, tmp_path: Path
) -> None:
    before = ModelCheckpoint(tmp_path / "a", "{epoch}", "loss")
    trainer = make_trainer()
    epoch_end(before, trainer, 0, loss=1.0)
    state = before.on_save_checkpoint(trainer, None)

    other_metric = ModelCheckpoint(tmp_path / "a", monitor="acc", mode="max")
    with pytest.warns(UserWarning, match="monitored 'loss'"):
        other_metric.on_load_checkpoint(state)
    assert other_metric.best_k_models == {} and other_metric.best_model_path == ""

    other_folder = ModelCheckpoint(tmp_path / "b", monitor="loss")
    with pytest.warns(UserWarning, match="those not in this run's folder .* are dropped"):
        other_folder.on_load_checkpoint(state)
    assert other_folder.best_model_path == ""  # a file of another folder is never named
    assert other_folder.best_k_models == {}
    assert other_folder.dirpath == os.path.realpath(tmp_path / "b")


# -- arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"mode": "auto"}, "mode='auto'"),
        ({"save_top_k": -2}, "save_top_k=-2"),
        ({"save_top_k": 3}, "save_top_k=3.*needs a metric"),
        ({"every_n_epochs": 0}, "every_n_epochs=0"),
        ({"filename": "{epoch}.ckpt"}, r"filename='\{epoch\}\.ckpt'\): leave out"),
        ({"monitor": 1}, "monitor=1"),
        ({"save_last": "yes"}, "save_last='yes'"),
    ],
)
def test_bad_arguments_are_refused_by_name(arguments: dict[str, Any], named: str) -> None:
    with pytest.raises(MisconfigurationError, match=f"ModelCheckpoint\\({named}"):
        ModelCheckpoint(**arguments)
