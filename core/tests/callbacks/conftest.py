"""A trainer as plain data for the callbacks' decision logic: the attributes they read, a
``save_checkpoint`` that writes a real file, and the one-process ``broadcast`` (identity).
The end-to-end tests (test_training.py) use the real ``cardcage.Trainer``."""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch


def write_file(path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(b"checkpoint")


def stand_in(tmp_path: Path, **metrics: float) -> types.SimpleNamespace:
    trainer = types.SimpleNamespace(
        callback_metrics={name: torch.tensor(value) for name, value in metrics.items()},
        current_epoch=0,
        global_step=0,
        global_rank=0,
        is_global_zero=True,
        sanity_checking=False,
        should_stop=False,
        validated_this_epoch=True,
        default_root_dir=str(tmp_path),
        flags=types.SimpleNamespace(fast_dev_run=False, check_val_every_n_epoch=1),
        logger=None,
        accelerator=types.SimpleNamespace(broadcast=lambda obj, src=0: obj),
        saved=[],
    )

    def save_checkpoint(path: str) -> None:
        trainer.saved.append(path)
        write_file(path)

    trainer.save_checkpoint = save_checkpoint
    return trainer


@pytest.fixture
def make_trainer(tmp_path: Path) -> Callable[..., Any]:
    return lambda **metrics: stand_in(tmp_path, **metrics)


def end_epoch(callback: Any, trainer: Any, epoch: int, **metrics: float) -> None:
    """Epoch ``epoch`` (10 steps each) ends with ``metrics``: the hooks the loop calls then,
    in its order."""
    trainer.current_epoch = epoch
    trainer.global_step = 10 * (epoch + 1)
    trainer.callback_metrics = {name: torch.tensor(value) for name, value in metrics.items()}
    callback.on_train_epoch_end(trainer, None, [])
    callback.on_epoch_end(trainer, None)


@pytest.fixture
def epoch_end() -> Callable[..., None]:
    return end_epoch
