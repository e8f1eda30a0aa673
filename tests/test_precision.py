"""Precision on the CPU: bf16 autocast, float64, and the precisions that are refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage
from cardcage import MisconfigurationError

F = torch.nn.functional


def loader(shuffle: bool = True) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(96, 6, generator=generator)
    labels = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return DataLoader(TensorDataset(x, labels), batch_size=16, shuffle=shuffle)


class Classifier(torch.nn.Module):
    """Records what autocast and dtypes looked like inside its steps."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3)
        )
        self.seen: list[tuple[bool, torch.dtype, torch.dtype, torch.dtype]] = []
        self.val_seen: list[tuple[bool, torch.dtype]] = []

    def loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self.net(x)
        return F.cross_entropy(logits, y), logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, logits = self.loss(batch)
        self.seen.append(
            (torch.is_autocast_enabled("cpu"), batch[0].dtype, batch[1].dtype, logits.dtype)
        )
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, logits = self.loss(batch)
        self.val_seen.append((torch.is_autocast_enabled("cpu"), logits.dtype))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def seeded() -> Classifier:
    torch.manual_seed(0)
    return Classifier()


def epoch_means(losses: list[float], epochs: int) -> list[float]:
    size = len(losses) // epochs
    return [sum(losses[i * size : (i + 1) * size]) / size for i in range(epochs)]


def assert_equal_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (key, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), key


def test_bf16_on_the_cpu_trains_under_autocast() -> None:
    model = seeded()
    trainer = cardcage.Trainer(max_epochs=3, precision="bf16", progress_bar=False)
    trainer.fit(model, loader(), loader(shuffle=False))

    assert trainer.accelerator.precision.autocast is not None
    assert trainer.accelerator.precision.scaler is None
    # Inside training_step: autocast on, matmuls in bfloat16; batches and weights untouched.
    assert model.seen and all(
        seen == (True, torch.float32, torch.int64, torch.bfloat16) for seen in model.seen
    )
    assert model.val_seen and all(seen == (True, torch.bfloat16) for seen in model.val_seen)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not torch.is_autocast_enabled("cpu")  # nothing leaks out of fit
    means = epoch_means(trainer.losses, 3)
    assert means[2] < means[1] < means[0]
    assert all(torch.isfinite(torch.tensor(trainer.losses)))


def test_bf16_equals_a_plain_autocast_loop() -> None:
    model = seeded()
    trainer = cardcage.Trainer(max_epochs=2, precision="bf16", progress_bar=False)
    trainer.fit(model, loader())

    reference = seeded()
    optimizer = reference.configure_optimizers()
    expected = []
    for _ in range(2):
        for batch in loader():
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = reference.loss(batch)[0]
            loss.backward()
            optimizer.step()
            expected.append(loss.item())
    assert_equal_weights(model, reference)
    assert trainer.losses == expected
    # ... and bf16 is not float32: the same run at 32 ends elsewhere.
    full = seeded()
    cardcage.Trainer(max_epochs=2, progress_bar=False).fit(full, loader())
    assert not torch.equal(full.net[0].weight, model.net[0].weight)


def test_precision_32_runs_without_autocast() -> None:
    model = seeded()
    trainer = cardcage.Trainer(max_epochs=1, progress_bar=False)
    trainer.fit(model, loader())
    assert trainer.accelerator.precision.autocast is None
    assert all(seen == (False, torch.float32, torch.int64, torch.float32) for seen in model.seen)


def test_precision_64_trains_in_float64() -> None:
    model = seeded()
    trainer = cardcage.Trainer(max_epochs=2, precision=64, progress_bar=False)
    trainer.fit(model, loader(), loader(shuffle=False))

    assert all(p.dtype == torch.float64 for p in model.parameters())
    # Floating batches are cast, integer labels are not.
    assert all(seen == (False, torch.float64, torch.int64, torch.float64) for seen in model.seen)
    assert all(seen == (False, torch.float64) for seen in model.val_seen)
    assert isinstance(trainer.logged_metrics["val_loss"], float)

    reference = seeded().double()
    optimizer = reference.configure_optimizers()
    expected = []
    for _ in range(2):
        for x, y in loader():
            optimizer.zero_grad()
            loss = reference.loss((x.double(), y))[0]
            loss.backward()
            optimizer.step()
            expected.append(loss.item())
    assert_equal_weights(model, reference)
    assert trainer.losses == expected


@pytest.mark.parametrize("value", [16, "16", 16.0])
def test_precision_16_on_the_cpu_is_refused_by_the_constructor(value: Any) -> None:
    with pytest.raises(MisconfigurationError, match=r"precision=16") as error:
        cardcage.Trainer(precision=value)
    message = str(error.value)
    assert "CUDA" in message and "bf16" in message  # why, and what to use instead


def test_precision_16_with_an_explicit_cpu_backend_is_refused() -> None:
    with pytest.raises(MisconfigurationError, match=r"precision=16.*'cpu'"):
        cardcage.Trainer(precision=16, distributed_backend="cpu")


@pytest.mark.parametrize("value", [8, "fp8", "half", "BF16", True, None, 33])
def test_an_unknown_precision_is_refused(value: Any) -> None:
    with pytest.raises(MisconfigurationError, match=r"precision=") as error:
        cardcage.Trainer(precision=value)
    assert repr(value) in str(error.value)


@pytest.mark.parametrize(("value", "expected"), [("32", 32), ("64", 64), ("bf16", "bf16")])
def test_precision_spellings(value: str, expected: int | str) -> None:
    assert cardcage.Trainer(precision=value).flags.precision == expected


@pytest.mark.slow
def test_bf16_under_ddp_spawn_pickles_and_trains() -> None:
    """Spawned workers receive the strategy by pickle; bf16's autocast was a lambda, and every
    ddp_spawn fit at bf16 failed with "Can't pickle local object". Now it trains, under
    autocast: the weights move, and differ from the same fit at 32."""
    from cardcage.testing import models

    def fit(precision: int | str) -> list[float]:
        model = models.KitModel()
        trainer = cardcage.Trainer(
            distributed_backend="ddp_spawn",
            num_processes=2,
            max_epochs=1,
            precision=precision,
            progress_bar=False,
            logger=False,
        )
        trainer.fit(model, models.loader(32, 8))
        return models.flat(model)

    start = models.flat(models.KitModel())
    bf16 = fit("bf16")
    assert bf16 != start
    assert bf16 != fit(32)
