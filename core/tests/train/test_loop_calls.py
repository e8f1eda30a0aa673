"""The loop trains as a plain loop does, and through a backend's own ``backward`` and
``optimizer_step`` when the backend overrides them: every step goes through both."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage
from cardcage import Accelerator, Availability

STEPS = 6


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(3, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def loader() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4 * STEPS, 3, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)


class HalvedSteps(Accelerator):
    """A backend that halves every loss before backward and counts its optimizer steps."""

    name = "halved"
    backwards = 0
    steps = 0

    @classmethod
    def availability(cls, ctx: Any) -> Availability:
        return Availability(True)

    def backward(self, loss: torch.Tensor) -> None:
        type(self).backwards += 1
        super().backward(loss * 0.5)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        type(self).steps += 1
        super().optimizer_step(optimizer)


def plain(scale: float) -> torch.Tensor:
    model = Model()
    optimizer = model.configure_optimizers()
    for batch_idx, batch in enumerate(loader()):
        optimizer.zero_grad()
        (model.training_step(batch, batch_idx) * scale).backward()
        optimizer.step()
    return model.layer.weight.detach().clone()


def test_the_default_backend_trains_as_a_plain_loop() -> None:
    model = Model()
    cardcage.Trainer(distributed_backend="cpu", max_epochs=1, progress_bar=False).fit(
        model, loader()
    )
    assert torch.equal(model.layer.weight, plain(1.0))


def test_a_backend_that_overrides_backward_and_the_step_sees_every_step(
    inprocess_accelerators: Callable[..., None],
) -> None:
    inprocess_accelerators("halved", HalvedSteps)
    HalvedSteps.backwards = HalvedSteps.steps = 0
    model = Model()
    trainer = cardcage.Trainer(distributed_backend="halved", max_epochs=1, progress_bar=False)
    trainer.fit(model, loader())
    assert (HalvedSteps.backwards, HalvedSteps.steps) == (STEPS, STEPS)
    assert torch.equal(model.layer.weight, plain(0.5))
    assert not torch.equal(model.layer.weight, plain(1.0))
