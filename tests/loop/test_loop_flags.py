"""The loop's flags in one process (fast_dev_run, limit_*_batches, check_val_every_n_epoch,
min_epochs, num_sanity_val_steps, deterministic, accumulate_grad_batches,
gradient_clip_val) and a model's own optimizer_step and backward hooks: batch counts, and
final weights equal to a plain PyTorch loop's from the same initial weights and data."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage

LR = 0.05


def dataset(samples: int, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 3, generator=g)
    return TensorDataset(x, x @ torch.tensor([[3.0], [-2.0], [1.5]]) + 2.0)


def loader(batches: int, batch_size: int = 4, seed: int = 1) -> DataLoader[Any]:
    return DataLoader(dataset(batches * batch_size, seed), batch_size=batch_size)


class Counting(cardcage.Module):
    """Counts its training and validation steps, with the epoch and sanity flag of each."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.train_steps: list[tuple[int, int]] = []  # (epoch, batch_idx)
        self.val_steps: list[tuple[int, int, bool]] = []  # (epoch, batch_idx, sanity)
        self.deterministic_seen: list[bool] = []

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.train_steps.append((self.current_epoch, batch_idx))
        self.deterministic_seen.append(torch.are_deterministic_algorithms_enabled())
        return self.loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        trainer = self.trainer
        assert trainer is not None
        self.val_steps.append((self.current_epoch, batch_idx, trainer.sanity_checking))
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def fit(model: torch.nn.Module, train: Any, val: Any = None, **flags: Any) -> cardcage.Trainer:
    trainer = cardcage.Trainer(progress_bar=False, **flags)
    trainer.fit(model, train, val)
    return trainer


# -- fast_dev_run and the limits -----------------------------------------------------------


def files_under(root: Path) -> list[str]:
    return [os.path.join(d, f) for d, _, names in os.walk(root) for f in names]


@pytest.mark.parametrize(("fast", "batches"), [(True, 1), (2, 2)])
def test_fast_dev_run_runs_that_many_batches_one_epoch_and_writes_nothing(
    tmp_path: Path, fast: bool | int, batches: int
) -> None:
    """max_epochs=5 and a checkpoint callback notwithstanding: one epoch of ``batches``
    training and validation batches, no sanity check, no file under default_root_dir."""
    root = tmp_path / "root"
    model = Counting()
    trainer = fit(
        model,
        loader(6),
        loader(4, seed=2),
        fast_dev_run=fast,
        max_epochs=5,
        num_sanity_val_steps=2,
        default_root_dir=str(root),
        callbacks=[cardcage.callbacks.ModelCheckpoint()],
    )
    assert model.train_steps == [(0, i) for i in range(batches)]
    assert model.val_steps == [(0, i, False) for i in range(batches)]
    assert trainer.global_step == batches
    assert files_under(root) == []


@pytest.mark.parametrize(
    ("train_limit", "val_limit", "train_batches", "val_batches"),
    [(2, 1, 2, 1), (0.5, 0.5, 3, 2), (0.34, 0.25, 2, 1), (1.0, 1.0, 6, 4)],
)
def test_limit_batches_as_count_and_fraction(
    train_limit: float | int, val_limit: float | int, train_batches: int, val_batches: int
) -> None:
    """6 training and 4 validation batches: an int is a count, a float a fraction rounded
    down (int(6 * 0.34) == 2); 1.0 is every batch."""
    model = Counting()
    trainer = fit(
        model,
        loader(6),
        loader(4, seed=2),
        max_epochs=2,
        limit_train_batches=train_limit,
        limit_val_batches=val_limit,
    )
    assert model.train_steps == [(e, i) for e in (0, 1) for i in range(train_batches)]
    assert model.val_steps == [(e, i, False) for e in (0, 1) for i in range(val_batches)]
    assert trainer.global_step == 2 * train_batches


def test_check_val_every_n_epoch() -> None:
    """5 epochs, check_val_every_n_epoch=2: validation after epochs 1 and 3 (0-based)."""
    model = Counting()
    fit(model, loader(2), loader(2, seed=2), max_epochs=5, check_val_every_n_epoch=2)
    assert sorted({e for e, _, _ in model.val_steps}) == [1, 3]
    assert len(model.val_steps) == 4


class StopAt(cardcage.Callback):
    """Asks to stop in on_train_epoch_end of ``epoch``; records the epochs that ended."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.ended: list[int] = []

    def on_train_epoch_end(self, trainer: Any, pl_module: Any, outputs: Any) -> None:
        self.ended.append(trainer.current_epoch)
        if trainer.current_epoch == self.epoch:
            trainer.should_stop = True


@pytest.mark.parametrize(("min_epochs", "epochs"), [(3, 3), (None, 1), (1, 1)])
def test_a_stop_request_waits_for_min_epochs(min_epochs: int | None, epochs: int) -> None:
    """should_stop set at the end of epoch 0, max_epochs=10: training ends after
    max(min_epochs, 1) epochs, each one whole."""
    model = Counting()
    stop = StopAt(0)
    trainer = fit(model, loader(3), max_epochs=10, min_epochs=min_epochs, callbacks=[stop])
    assert stop.ended == list(range(epochs))
    assert len(model.train_steps) == 3 * epochs
    assert trainer.global_step == 3 * epochs


class SanityWatch(cardcage.Callback):
    def __init__(self) -> None:
        self.at_train_start: dict[str, float] = {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.at_train_start = {k: float(v) for k, v in trainer.callback_metrics.items()}
        self.logged_at_train_start = dict(trainer.logged_metrics)


def test_num_sanity_val_steps_runs_that_many_validation_steps_and_records_nothing() -> None:
    """num_sanity_val_steps=2 with 4 validation batches: 2 validation steps before any
    training step (sanity_checking True), none of their values in callback_metrics or
    logged_metrics; then the epoch's full validation."""
    model = Counting()
    watch = SanityWatch()
    trainer = fit(
        model, loader(3), loader(4, seed=2), max_epochs=1, num_sanity_val_steps=2, callbacks=[watch]
    )
    assert model.val_steps == [
        (0, 0, True),
        (0, 1, True),
        *[(0, i, False) for i in range(4)],
    ]
    assert watch.at_train_start == {}
    assert "val_loss" not in watch.logged_at_train_start
    assert not trainer.sanity_checking
    # the value after fit is the full validation's, over all 4 batches with the final weights
    with torch.no_grad():
        losses = [float(model.loss(b)) for b in loader(4, seed=2)]
    assert float(trainer.callback_metrics["val_loss"]) == pytest.approx(sum(losses) / 4, rel=1e-6)


@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_holds_inside_the_steps_only(deterministic: bool) -> None:
    assert not torch.are_deterministic_algorithms_enabled()
    model = Counting()
    fit(model, loader(2), max_epochs=1, deterministic=deterministic)
    assert model.deterministic_seen == [deterministic, deterministic]
    assert not torch.are_deterministic_algorithms_enabled()


# -- accumulation, clipping and the model's own hooks against the plain loop -----------------


class Plain(cardcage.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 8)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.layer(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def plain_loop(
    model: torch.nn.Module,
    batches: DataLoader[Any] | list[Any],
    epochs: int,
    accumulate: int = 1,
    after_backward: Callable[[torch.nn.Module], None] | None = None,
    before_step: Callable[[torch.optim.Optimizer, int], None] | None = None,
    max_steps: int | None = None,
) -> int:
    """The hand-written loop; returns the optimizer steps taken."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    steps = 0
    for _ in range(epochs):
        n = len(batches)
        optimizer.zero_grad()
        for i, (x, y) in enumerate(batches):
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss / accumulate).backward()
            if (i + 1) % accumulate == 0 or i + 1 == n:
                if after_backward is not None:
                    after_backward(model)
                if before_step is not None:
                    before_step(optimizer, steps)
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
                if steps == max_steps:
                    return steps
    return steps


def assert_same_weights(got: torch.nn.Module, want: torch.nn.Module) -> None:
    for (name, a), (_, b) in zip(got.named_parameters(), want.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)


def limited(batches: DataLoader[Any], count: int) -> list[Any]:
    return [b for i, b in enumerate(batches) if i < count]


@pytest.mark.parametrize(
    ("flag", "value", "steps"), [("limit_train_batches", 5, 4), ("max_steps", 3, 3)]
)
def test_accumulation_with_a_limit_steps_on_the_limits_last_batch(
    flag: str, value: int, steps: int
) -> None:
    """accumulate_grad_batches=3 over 8 batches, 2 epochs. limit_train_batches=5: each epoch
    steps after batches 3 and 5 (its last). max_steps=3: steps after batches 3 and 6 of
    epoch 0 and 3 of epoch 1, then stops (global_step counts optimizer steps)."""
    torch.manual_seed(0)
    model = Plain()
    reference = copy.deepcopy(model)
    train = loader(8)
    trainer = fit(model, train, max_epochs=2, accumulate_grad_batches=3, **{flag: value})
    assert trainer.global_step == steps
    if flag == "limit_train_batches":
        plain_loop(reference, limited(train, 5), epochs=2, accumulate=3)
    else:
        plain_loop(reference, train, epochs=2, accumulate=3, max_steps=3)
    assert_same_weights(model, reference)


def test_accumulate_grad_batches_equals_the_plain_loop_and_counts_optimizer_steps() -> None:
    """accumulate_grad_batches=3, 8 batches, 2 epochs: loss/3 accumulated, steps after
    batches 3, 6 and 8 of each epoch; global_step 6."""
    torch.manual_seed(0)
    model = Plain()
    reference = copy.deepcopy(model)
    train = loader(8)
    trainer = fit(model, train, max_epochs=2, accumulate_grad_batches=3)
    steps = plain_loop(reference, train, epochs=2, accumulate=3)
    assert steps == 6 and trainer.global_step == 6
    assert_same_weights(model, reference)
    # the reference is not the loop without accumulation
    torch.manual_seed(0)
    fresh = Plain()
    plain_loop(fresh, train, epochs=2)
    assert not torch.allclose(fresh.out.weight, reference.out.weight, atol=1e-4)


@pytest.mark.parametrize(
    ("algorithm", "value", "clip"),
    [
        ("norm", 0.5, lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)),
        ("value", 0.05, lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 0.05)),
    ],
)
def test_gradient_clipping_equals_the_plain_loop(
    algorithm: str, value: float, clip: Callable[[torch.nn.Module], None]
) -> None:
    """gradient_clip_val with each algorithm, alone and with accumulate_grad_batches=2 (the
    accumulated gradient is clipped once, before its step)."""
    for accumulate in (1, 2):
        torch.manual_seed(0)
        model = Plain()
        reference = copy.deepcopy(model)
        unclipped = copy.deepcopy(model)
        train = loader(5)
        fit(
            model,
            train,
            max_epochs=2,
            gradient_clip_val=value,
            gradient_clip_algorithm=algorithm,
            accumulate_grad_batches=accumulate,
        )
        plain_loop(reference, train, epochs=2, accumulate=accumulate, after_backward=clip)
        assert_same_weights(model, reference)
        plain_loop(unclipped, train, epochs=2, accumulate=accumulate)
        assert not torch.allclose(unclipped.out.weight, reference.out.weight, atol=1e-4)


WARMUP = 4


def warmup_lr(steps_done: int) -> float:
    return LR * min(1.0, (steps_done + 1) / WARMUP)


class WarmUp(Plain):
    """Lightning 1.0's learning-rate warm-up through its own optimizer_step; its own
    backward, counted."""

    def __init__(self) -> None:
        super().__init__()
        self.backward_calls = 0
        self.lrs: list[float] = []
        self.step_args: list[tuple[int, int, int, bool, bool, bool]] = []

    def backward(self, loss: torch.Tensor, optimizer: Any, optimizer_idx: int) -> None:
        self.backward_calls += 1
        loss.backward()

    def optimizer_step(
        self,
        epoch: int,
        batch_idx: int,
        optimizer: Any,
        optimizer_idx: int,
        optimizer_closure: Any,
        on_tpu: bool,
        using_native_amp: bool,
        using_lbfgs: bool,
    ) -> None:
        lr = warmup_lr(self.global_step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        self.lrs.append(lr)
        self.step_args.append(
            (epoch, batch_idx, optimizer_idx, on_tpu, using_native_amp, using_lbfgs)
        )
        optimizer.step(closure=optimizer_closure)


def set_warmup(optimizer: torch.optim.Optimizer, steps_done: int) -> None:
    for group in optimizer.param_groups:
        group["lr"] = warmup_lr(steps_done)


def test_a_models_optimizer_step_and_backward_hooks_train_as_the_plain_loop() -> None:
    """The warm-up changes lr then steps through optimizer.step(closure=...): the weights
    equal the plain loop's with the same schedule; backward is the model's, once a batch."""
    torch.manual_seed(0)
    model = WarmUp()
    reference = copy.deepcopy(model)
    train = loader(3)
    trainer = fit(model, train, max_epochs=2)
    plain_loop(reference, train, epochs=2, before_step=set_warmup)
    assert_same_weights(model, reference)
    assert model.backward_calls == 6
    assert model.lrs == [warmup_lr(s) for s in range(6)]
    assert model.step_args == [(e, i, 0, False, False, False) for e in (0, 1) for i in range(3)]
    assert trainer.global_step == 6


class ValidationHooks(Counting):
    def __init__(self) -> None:
        super().__init__()
        self.epoch_ends = 0

    def validation_epoch_end(self, outputs: list[Any]) -> None:
        self.epoch_ends += 1


class ValidationStarts(cardcage.Callback):
    def __init__(self) -> None:
        self.starts = 0

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.starts += 1


def test_limit_val_batches_zero_runs_no_validation() -> None:
    """Lightning 1.0 validates only when limit_val_batches > 0: no validation hook runs
    (validation_epoch_end over no outputs would be a validation of nothing)."""
    model = ValidationHooks()
    starts = ValidationStarts()
    fit(model, loader(2), loader(2, seed=2), max_epochs=2, limit_val_batches=0, callbacks=[starts])
    assert model.val_steps == []
    assert model.epoch_ends == 0
    assert starts.starts == 0


class Broken(Counting):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        super().training_step(batch, batch_idx)
        raise ValueError("step failed")


def test_deterministic_is_undone_when_fit_fails() -> None:
    model = Broken()
    with pytest.raises(ValueError, match="step failed"):
        fit(model, loader(2), max_epochs=1, deterministic=True)
    assert model.deterministic_seen == [True]
    assert not torch.are_deterministic_algorithms_enabled()


class HookCounts(Plain):
    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}
        self.norms_after_backward: list[float] = []

    def count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.count("training_step")
        return super().training_step(batch, batch_idx)

    def on_after_backward(self) -> None:
        self.count("on_after_backward")
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.norms_after_backward.append(
            float(
                torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            )
        )

    def on_before_zero_grad(self, optimizer: Any) -> None:
        self.count("on_before_zero_grad")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int, idx: int) -> None:
        self.count("on_train_batch_end")


def test_under_accumulation_the_step_hooks_run_on_stepping_batches_only() -> None:
    """accumulate_grad_batches=3, 8 batches: every batch runs training_step and
    on_train_batch_end; on_after_backward and on_before_zero_grad run at the 3 steps."""
    model = HookCounts()
    trainer = fit(model, loader(8), max_epochs=1, accumulate_grad_batches=3)
    assert model.calls == {
        "training_step": 8,
        "on_train_batch_end": 8,
        "on_after_backward": 3,
        "on_before_zero_grad": 3,
    }
    assert trainer.global_step == 3


def test_on_after_backward_sees_the_gradients_before_clipping() -> None:
    """LOOP_API.md: clipping runs after on_after_backward, before the optimizer step."""
    model = HookCounts()
    fit(model, loader(3), max_epochs=1, gradient_clip_val=0.01)
    assert len(model.norms_after_backward) == 3
    assert min(model.norms_after_backward) > 0.01


@pytest.mark.parametrize(
    ("val_limit", "sanity", "sanity_batches"), [(1, 3, 1), (0.5, -1, 2), (1.0, -1, 4), (3, 2, 2)]
)
def test_the_sanity_check_runs_at_most_limit_val_batches(
    val_limit: float | int, sanity: int, sanity_batches: int
) -> None:
    """Lightning 1.0: min(num_sanity_val_steps, the validation batches limit_val_batches
    lets run); -1 is all of those."""
    model = Counting()
    fit(
        model,
        loader(2),
        loader(4, seed=2),
        max_epochs=1,
        limit_val_batches=val_limit,
        num_sanity_val_steps=sanity,
    )
    assert [i for _, i, checking in model.val_steps if checking] == list(range(sanity_batches))
