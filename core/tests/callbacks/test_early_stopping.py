"""EarlyStopping's counting, driven through its hook with a trainer as plain data: when it
asks to stop, what counts as improving, what it skips, and its state."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from cardcage import MisconfigurationError
from cardcage.callbacks import EarlyStopping

EpochEnd = Callable[..., None]


def run(stopper: EarlyStopping, trainer: Any, epoch_end: EpochEnd, values: list[float]) -> int:
    """The first epoch at which ``stopper`` asked to stop (-1: never)."""
    for epoch, value in enumerate(values):
        epoch_end(stopper, trainer, epoch, loss=value)
        if trainer.should_stop:
            return epoch
    return -1


@pytest.mark.parametrize(
    ("mode", "values", "patience", "stopped"),
    [
        ("min", [3.0, 2.0, 2.5, 2.4, 1.0], 2, 3),  # epochs 2 and 3 do not beat 2.0
        ("min", [3.0, 2.0, 2.5, 1.0, 2.4, 2.3], 2, 5),  # an improvement resets the count
        ("max", [1.0, 2.0, 1.5, 1.9, 3.0], 2, 3),
        ("min", [3.0, 2.0, 2.5], 1, 2),  # patience=1: the first check that does not improve
        ("min", [3.0, 2.0, 1.0, 0.5], 1, -1),
        ("min", [1.0, math.nan, math.nan], 2, 2),  # NaN never improves
    ],
)
def test_it_asks_to_stop_when_patience_is_spent(
    make_trainer: Callable[..., Any],
    epoch_end: EpochEnd,
    mode: str,
    values: list[float],
    patience: int,
    stopped: int,
) -> None:
    stopper = EarlyStopping("loss", patience=patience, mode=mode)
    trainer = make_trainer()
    assert run(stopper, trainer, epoch_end, values) == stopped
    if stopped >= 0:
        assert stopper.stopped_epoch == stopped
        assert stopper.wait_count == patience


def test_min_delta_is_the_improvement_that_counts(
    make_trainer: Callable[..., Any], epoch_end: EpochEnd
) -> None:
    stopper = EarlyStopping("loss", min_delta=0.5, patience=2)
    trainer = make_trainer()
    assert run(stopper, trainer, epoch_end, [3.0, 2.6, 2.7, 1.0]) == 2
    assert float(stopper.best_score) == 3.0
    stopper = EarlyStopping("loss", min_delta=0.5, patience=2)
    assert run(stopper, make_trainer(), epoch_end, [3.0, 2.4, 1.8, 1.2]) == -1
    assert float(stopper.best_score) == pytest.approx(1.2)


def test_sanity_checks_and_epochs_between_validations_are_not_counted(
    make_trainer: Callable[..., Any], epoch_end: EpochEnd
) -> None:
    stopper = EarlyStopping("val_loss", patience=1)
    trainer = make_trainer()
    trainer.sanity_checking = True
    epoch_end(stopper, trainer, 0, val_loss=1.0)
    assert float(stopper.best_score) == math.inf
    trainer.sanity_checking = False
    trainer.flags.check_val_every_n_epoch = 2
    trainer.validated_this_epoch = False
    epoch_end(stopper, trainer, 0)  # no val_loss yet: no error, even strict
    trainer.validated_this_epoch = True
    epoch_end(stopper, trainer, 1, val_loss=1.0)
    trainer.validated_this_epoch = False
    epoch_end(stopper, trainer, 2, val_loss=1.0)  # the same, stale value: not a check
    assert (stopper.wait_count, trainer.should_stop) == (0, False)
    trainer.validated_this_epoch = True
    epoch_end(stopper, trainer, 3, val_loss=1.0)
    assert (stopper.wait_count, trainer.should_stop, stopper.stopped_epoch) == (1, True, 3)


def test_a_missing_monitor_raises_when_strict_else_warns_once(
    make_trainer: Callable[..., Any], epoch_end: EpochEnd
) -> None:
    with pytest.raises(MisconfigurationError, match=r"'val_acc'.*available: loss, val_loss"):
        epoch_end(EarlyStopping("val_acc"), make_trainer(), 0, loss=1.0, val_loss=1.0)
    lenient = EarlyStopping("val_acc", strict=False, patience=0)
    trainer = make_trainer()
    with pytest.warns(UserWarning, match="'val_acc' is not in") as caught:
        for epoch in range(3):
            epoch_end(lenient, trainer, epoch, loss=1.0)
    assert len(caught) == 1
    assert not trainer.should_stop


def test_the_state_comes_back(make_trainer: Callable[..., Any], epoch_end: EpochEnd) -> None:
    before = EarlyStopping("loss", patience=3)
    trainer = make_trainer()
    run(before, trainer, epoch_end, [2.0, 3.0, 3.0])
    state = before.on_save_checkpoint(trainer, None)
    after = EarlyStopping("loss", patience=3)
    after.on_load_checkpoint(state)
    assert (after.wait_count, float(after.best_score)) == (2, 2.0)
    epoch_end(after, trainer, 3, loss=2.5)
    assert trainer.should_stop and after.stopped_epoch == 3

    other = EarlyStopping("acc", mode="max")
    with pytest.warns(UserWarning, match="count starts afresh"):
        other.on_load_checkpoint(state)
    assert (other.wait_count, float(other.best_score)) == (0, -math.inf)
    assert isinstance(after.best_score, torch.Tensor)


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"monitor": None}, "monitor=None"),
        ({"monitor": "loss", "mode": "auto"}, "mode='auto'"),
        ({"monitor": "loss", "patience": -1}, "patience=-1"),
        ({"monitor": "loss", "min_delta": -0.1}, "min_delta=-0.1"),
        ({"monitor": "loss", "strict": "no"}, "strict='no'"),
    ],
)
def test_bad_arguments_are_refused_by_name(arguments: dict[str, Any], named: str) -> None:
    with pytest.raises(MisconfigurationError, match=f"EarlyStopping\\({named}"):
        EarlyStopping(**arguments)
