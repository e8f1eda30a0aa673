"""Faults in the training loop say what went wrong, early (one process, on the CPU).

- A NaN or infinite training loss warns once, naming the step (``global_step``, epoch and
  ``batch_idx``), within ``LOSS_CHUNK`` steps; with ``terminate_on_nan=True`` ``fit`` raises
  ``NonFiniteLossError`` at that step, before its backward and optimizer step.
- An empty train loader warns that no step will run, or is a ``MisconfigurationError`` when
  ``max_steps`` asks for steps, before training starts; an epoch whose loader yields nothing
  (a generator used up in the first epoch) likewise.
- A loss with more than one value is a ``MisconfigurationError`` naming ``training_step``, the
  shape and the fix, before any backward; a loss of shape ``[1]`` trains as a scalar does.

The two-process versions (a NaN on one rank, shards with no batch) are in
``tests/distributed/test_loop_faults.py``.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from processes import watching_children
from torch.utils.data import DataLoader, TensorDataset

import cardcage
from cardcage import MisconfigurationError, NonFiniteLossError
from cardcage.train.loop import LOSS_CHUNK

F = torch.nn.functional


def loader(samples: int, batch_size: int = 2, **options: Any) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(samples, 4, generator=generator)
    return DataLoader(TensorDataset(x, x[:, :1] - x[:, 1:2]), batch_size=batch_size, **options)


class Net(torch.nn.Module):
    """A linear regression whose loss turns ``bad`` (NaN, inf) at its ``bad_at``-th call
    (0-based, so that it equals ``global_step`` in a fresh fit), and whose loss can be
    returned with another shape or in a dict."""

    def __init__(self, bad_at: int | None = None, bad: float = math.nan, shape: Any = None):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.bad_at, self.bad, self.shape = bad_at, bad, shape
        self.calls = 0
        self.as_dict = False

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = self.loss(batch)
        if self.calls == self.bad_at:
            loss = loss * self.bad
        self.calls += 1
        if self.shape is not None:
            loss = loss.expand(self.shape) if math.prod(self.shape) else loss.reshape(-1)[:0]
        return {"loss": loss} if self.as_dict else loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit(model: torch.nn.Module, data: Any, **flags: Any) -> cardcage.Trainer:
    flags.setdefault("progress_bar", False)
    trainer = cardcage.Trainer(**flags)
    trainer.fit(model, data)
    return trainer


def plain_weights(steps: int, data: DataLoader[Any]) -> dict[str, torch.Tensor]:
    """The weights after ``steps`` steps of a hand-written loop over ``data`` (repeated)."""
    model = Net()
    optimizer = model.configure_optimizers()
    done = 0
    while done < steps:
        for batch in data:
            if done == steps:
                break
            optimizer.zero_grad()
            model.loss(batch).backward()
            optimizer.step()
            done += 1
    return model.state_dict()


def assert_weights(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for key in state:
        assert torch.equal(state[key], expected[key]), key


def cardcage_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith("cardcage:")]


# -- terminate_on_nan: the flag -----------------------------------------------------------------


def test_terminate_on_nan_is_a_flag_defaulting_to_false() -> None:
    assert cardcage.Trainer().flags.terminate_on_nan is False
    assert cardcage.Trainer(terminate_on_nan=True).flags.terminate_on_nan is True
    assert cardcage.select(terminate_on_nan=True).flags.terminate_on_nan is True


@pytest.mark.parametrize("value", ["yes", 1.5, 1, None])
def test_a_bad_terminate_on_nan_is_refused_by_the_constructor(value: Any) -> None:
    with pytest.raises(MisconfigurationError) as error:
        cardcage.Trainer(terminate_on_nan=value)
    message = str(error.value)
    assert f"terminate_on_nan={value!r} is not valid" in message
    assert "must be True" in message and "or False" in message


# -- a NaN or infinite loss, terminate_on_nan=False: one warning ---------------------------------


@pytest.mark.parametrize(
    ("bad_at", "steps_per_epoch", "epoch", "batch_idx"),
    [
        (5, 8, 0, 5),  # the epoch's remainder (fewer than LOSS_CHUNK steps)
        (70, 200, 0, 70),  # a whole chunk: steps 64..127
        (150, 100, 1, 50),  # the second epoch's first chunk: steps 100..163
        (199, 100, 1, 99),  # the last step of the fit
    ],
)
def test_a_nan_loss_warns_once_naming_its_step(
    bad_at: int, steps_per_epoch: int, epoch: int, batch_idx: int
) -> None:
    model = Net(bad_at)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = fit(model, loader(2 * steps_per_epoch), max_epochs=2)
    said = cardcage_warnings(record)
    assert len(said) == 1, said  # every later loss is NaN too: still one warning
    assert (
        f"training_step returned a loss of nan at global_step={bad_at} "
        f"(epoch {epoch}, batch_idx={batch_idx})" in said[0]
    )
    assert "terminate_on_nan=True" in said[0]  # the fix
    assert [w.category for w in record if "cardcage:" in str(w.message)] == [RuntimeWarning]
    assert trainer.global_step == 2 * steps_per_epoch  # training went on
    assert math.isnan(trainer.losses[bad_at]) and not math.isnan(trainer.losses[bad_at - 1])


@pytest.mark.parametrize("bad", [math.inf, -math.inf])
def test_an_infinite_loss_warns_naming_its_step(bad: float) -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(Net(3, bad), loader(16), max_epochs=1)
    said = cardcage_warnings(record)
    assert len(said) == 1, said
    assert f"a loss of {bad} at global_step=3 (epoch 0, batch_idx=3)" in said[0]


def test_the_warning_comes_within_one_chunk_of_the_nan() -> None:
    # Turned into an error (python -W error), the warning stops fit: at most LOSS_CHUNK steps
    # after the NaN, not at the end of the epoch.
    model = Net(10)
    trainer = cardcage.Trainer(max_epochs=1, progress_bar=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(RuntimeWarning, match="global_step=10 "):
            trainer.fit(model, loader(2 * 1000))
    assert 10 < trainer.global_step <= 10 + LOSS_CHUNK


def test_finite_losses_warn_nothing_and_train_as_before() -> None:
    data = loader(40)
    for terminate in (False, True):
        model = Net()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            trainer = fit(model, data, max_epochs=3, terminate_on_nan=terminate)
        assert cardcage_warnings(record) == []
        assert trainer.global_step == 60
        assert_weights(model, plain_weights(60, data))


# -- terminate_on_nan=True: fit raises at the step ------------------------------------------------


@pytest.mark.parametrize(("bad", "shown"), [(math.nan, "nan"), (math.inf, "inf")])
def test_terminate_on_nan_raises_at_the_step_before_it_changes_the_weights(
    bad: float, shown: str
) -> None:
    data = loader(16)  # 8 steps an epoch: the bad loss is at epoch 1, batch_idx 3
    model = Net(11, bad)
    trainer = cardcage.Trainer(max_epochs=2, terminate_on_nan=True, progress_bar=False)
    with pytest.raises(NonFiniteLossError) as error:
        trainer.fit(model, data)
    message = str(error.value)
    assert f"training_step returned a loss of {shown} at global_step=11 " in message
    assert "(epoch 1, batch_idx=3)" in message
    assert "terminate_on_nan=True stopped training there" in message
    assert (error.value.global_step, error.value.epoch, error.value.batch_idx) == (11, 1, 3)
    assert isinstance(error.value, RuntimeError)
    assert trainer.global_step == 11
    assert_weights(model, plain_weights(11, data))  # the bad step neither backward nor stepped
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


class TwoOptimizers(Net):
    """Lightning 1.0's per-optimizer steps; optimizer 1's loss is NaN at the third batch."""

    def __init__(self) -> None:
        super().__init__()
        self.other = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int, optimizer_idx: int = 0) -> Any:
        x, y = batch
        if optimizer_idx == 0:
            return self.loss(batch)
        loss = F.mse_loss(self.other(x), y)
        return loss * math.nan if batch_idx == 2 else loss

    def configure_optimizers(self) -> Any:
        return [
            torch.optim.SGD(self.layer.parameters(), lr=0.05),
            torch.optim.SGD(self.other.parameters(), lr=0.05),
        ]


def test_terminate_on_nan_checks_every_optimizers_loss() -> None:
    model = TwoOptimizers()
    trainer = cardcage.Trainer(terminate_on_nan=True, progress_bar=False)
    with pytest.raises(NonFiniteLossError, match=r"global_step=2 \(epoch 0, batch_idx=2\)"):
        trainer.fit(model, loader(16))
    assert all(torch.isfinite(p).all() for p in model.other.parameters())


# -- an empty train loader -----------------------------------------------------------------------


def test_an_empty_loader_warns_that_no_step_will_run() -> None:
    model = Net()
    before = copy.deepcopy(model.state_dict())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = fit(model, loader(0))
    said = cardcage_warnings(record)
    assert len(said) == 1, said  # from fit, before training; the loop does not repeat it
    assert "train_dataloader has length 0: no training step will run" in said[0]
    assert "Its dataset is empty." in said[0]
    assert [w.category for w in record if "cardcage:" in str(w.message)] == [UserWarning]
    assert trainer.global_step == 0 and model.calls == 0
    assert_weights(model, before)


def test_an_empty_loader_with_max_steps_is_refused_before_any_process_starts() -> None:
    # ddp_spawn would train in two new processes: a failure there would be a RankFailedError.
    trainer = cardcage.Trainer(
        distributed_backend="ddp_spawn", num_processes=2, max_steps=5, progress_bar=False
    )
    with watching_children() as started, pytest.raises(MisconfigurationError) as error:
        trainer.fit(Net(), loader(0))
    assert not started, f"processes started before the error: {started}"
    message = str(error.value)
    assert "train_dataloader has length 0, but max_steps=5 asks for 5 training steps" in message
    assert "Give train_dataloader at least one batch, or leave max_steps=None" in message


def test_an_empty_loader_names_drop_last_when_it_dropped_the_only_batch() -> None:
    with pytest.raises(MisconfigurationError) as error:
        fit(Net(), loader(3, batch_size=8, drop_last=True), max_steps=2)
    message = str(error.value)
    assert "drop_last=True drops its only batch" in message
    assert "the dataset holds 3 sample(s), fewer than batch_size=8" in message


def batches(data: DataLoader[Any]) -> Iterator[Any]:
    yield from data  # a generator: its batches come once, in the first epoch only


def test_a_loader_used_up_after_the_first_epoch_warns() -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = fit(Net(), batches(loader(8)), max_epochs=3)
    said = cardcage_warnings(record)
    assert len(said) == 1, said  # epochs 1 and 2 are empty: one warning
    assert "train_dataloader yielded no batch in epoch 1: no training step ran" in said[0]
    assert "(a generator)" in said[0]
    assert trainer.global_step == 4


def test_a_loader_used_up_with_max_steps_fails_instead_of_spinning() -> None:
    # With max_epochs=None, max_steps alone ends training: without a step, epochs would
    # follow each other for ever.
    with pytest.raises(MisconfigurationError) as error:
        fit(Net(), batches(loader(8)), max_epochs=None, max_steps=20)
    message = str(error.value)
    assert "train_dataloader yielded no batch in epoch 1" in message
    assert "but max_steps=20 asks for 16 more training steps" in message


# -- a loss with more than one value ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "as_dict", "says"),
    [
        ((2,), False, "training_step returned a loss of shape [2] (2 values)"),
        ((2, 1), True, "training_step returned a dict whose 'loss' has shape [2, 1] (2 values)"),
        ((0,), False, "training_step returned a loss of shape [0] (0 values)"),
    ],
)
def test_a_loss_of_several_values_is_refused_naming_the_shape_and_the_fix(
    shape: tuple[int, ...], as_dict: bool, says: str
) -> None:
    model = Net(shape=shape)
    model.as_dict = as_dict
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(MisconfigurationError) as error:
        fit(model, loader(8))
    message = str(error.value)
    assert says in message
    assert "Reduce it in training_step, e.g. return loss.mean()" in message
    assert "grad can be implicitly created" not in message
    assert_weights(model, before)


def test_a_loss_of_shape_1_trains_like_a_scalar() -> None:
    data = loader(16)
    model = Net(shape=(1,))
    trainer = fit(model, data, max_epochs=2)
    assert trainer.global_step == 16
    assert_weights(model, plain_weights(16, data))
    assert len(trainer.losses) == 16 and all(type(v) is float for v in trainer.losses)
    assert type(trainer.logged_metrics["loss"]) is float
