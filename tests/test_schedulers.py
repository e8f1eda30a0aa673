"""Learning-rate schedulers in every form Lightning 1.0's ``configure_optimizers`` accepted,
against a plain PyTorch loop from the same seed: the learning rate each step saw and the
final weights must be equal (on the CPU, bit-equal)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage
from cardcage import MisconfigurationError

F = torch.nn.functional
Sched = torch.optim.lr_scheduler


def data(seed: int, samples: int = 32) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 4, generator=generator)
    return DataLoader(TensorDataset(x, (x[:, :1] - 2 * x[:, 1:2]).tanh()), batch_size=8)


def net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


# What configure_optimizers returns, given (parameters of part a, of part b); one optimizer
# per part, except where the entry builds a single optimizer over both.
Configure = Callable[[torch.nn.Sequential], tuple[Any, list[torch.optim.Optimizer]]]


class Model(torch.nn.Module):
    def __init__(self, configure: Configure, validate: bool = True):
        super().__init__()
        self.net = net()
        self.configure = configure
        self.lrs: list[list[float]] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        if validate:
            self.validation_step = self._validation_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.lrs.append([o.param_groups[0]["lr"] for o in self.optimizers])
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def _validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        result, self.optimizers = self.configure(self.net)
        return result


def plain(
    configure: Configure,
    epochs: int,
    step: Callable[[Any, int, int, float], None],
) -> tuple[torch.nn.Sequential, list[list[float]]]:
    """The loop a user writes; ``step(result, global_step, epoch_done, val_loss)`` steps the
    schedulers (epoch_done = -1 after an optimizer step, else the epochs done)."""
    model = net()
    result, optimizers = configure(model)
    lrs: list[list[float]] = []
    steps = 0
    for epoch in range(epochs):
        for x, y in data(1):
            lrs.append([o.param_groups[0]["lr"] for o in optimizers])
            for o in optimizers:
                o.zero_grad()
            loss: torch.Tensor = F.mse_loss(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            for o in optimizers:
                o.step()
            steps += 1
            step(result, steps, -1, 0.0)
        with torch.no_grad():  # weighted mean: all val batches are full here
            val = sum(float(F.mse_loss(model(x), y)) for x, y in data(2)) / len(data(2))
        step(result, steps, epoch + 1, val)
    return model, lrs


def fit(model: torch.nn.Module, epochs: int, **flags: Any) -> cardcage.Trainer:
    trainer = cardcage.Trainer(max_epochs=epochs, progress_bar=False, **flags)
    trainer.fit(model, data(1), data(2))
    return trainer


def check(model: Model, reference: torch.nn.Module, lrs: list[list[float]]) -> None:
    assert model.lrs == lrs
    for ours, theirs in zip(model.net.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def test_a_step_interval_scheduler_steps_after_every_optimizer_step() -> None:
    def configure(m: torch.nn.Sequential) -> Any:
        o = sgd(m.parameters())
        s = Sched.ExponentialLR(o, gamma=0.5)
        return {"optimizer": o, "lr_scheduler": {"scheduler": s, "interval": "step"}}, [o]

    def step(result: Any, steps: int, epoch: int, val: float) -> None:
        if epoch < 0:
            result["lr_scheduler"]["scheduler"].step()

    model = Model(configure)
    fit(model, 2)
    reference, lrs = plain(configure, 2, step)
    check(model, reference, lrs)
    assert lrs[-1] == [0.1 * 0.5**7]  # 8 steps: the 8th ran at lr 0.1 * 0.5**7


def test_frequency_two_for_step_and_epoch_intervals() -> None:
    def configure(m: torch.nn.Sequential) -> Any:
        a, b = sgd(m[0].parameters()), sgd(m[2].parameters())
        scheds = [
            {"scheduler": Sched.StepLR(a, 1, gamma=0.5), "interval": "step", "frequency": 2},
            {"scheduler": Sched.StepLR(b, 1, gamma=0.5), "frequency": 2},  # epoch
        ]
        return ([a, b], scheds), [a, b]

    def step(result: Any, steps: int, epoch: int, val: float) -> None:
        first, second = result[1]
        if epoch < 0 and steps % 2 == 0:
            first["scheduler"].step()
        if epoch > 0 and epoch % 2 == 0:
            second["scheduler"].step()

    model = Model(configure)
    fit(model, 3)
    reference, lrs = plain(configure, 3, step)
    check(model, reference, lrs)
    assert lrs[-1] == [0.1 * 0.5**5, 0.1 * 0.5]


def test_reduce_on_plateau_is_stepped_with_the_monitored_validation_metric() -> None:
    # mode="max" on a falling val_loss: no improvement after the first epoch, so with
    # patience 0 it halves the rate every later epoch, but only if it gets val_loss.
    def configure(m: torch.nn.Sequential) -> Any:
        o = sgd(m.parameters())
        s = Sched.ReduceLROnPlateau(o, mode="max", factor=0.5, patience=0)
        return {"optimizer": o, "lr_scheduler": s, "monitor": "val_loss"}, [o]

    values: list[float] = []

    def step(result: Any, steps: int, epoch: int, val: float) -> None:
        if epoch > 0:
            values.append(val)
            result["lr_scheduler"].step(val)

    model = Model(configure)
    trainer = fit(model, 4)
    reference, lrs = plain(configure, 4, step)
    check(model, reference, lrs)
    assert len({lr for (lr,) in lrs}) > 1  # it did reduce: the comparison is not vacuous
    (ours,) = trainer.optimization.schedulers
    assert ours.best == pytest.approx(max(values), rel=1e-9)  # it saw the val_loss values


def test_a_step_reduce_on_plateau_monitoring_loss_gets_each_steps_loss() -> None:
    def configure(m: torch.nn.Sequential) -> Any:
        o = sgd(m.parameters())
        s = Sched.ReduceLROnPlateau(o, mode="max", factor=0.5, patience=0)
        entry = {"scheduler": s, "interval": "step", "monitor": "loss"}
        return {"optimizer": o, "lr_scheduler": entry}, [o]

    model = Model(configure, validate=False)
    trainer = fit(model, 2)
    reference = net()
    result, (optimizer,) = configure(reference)
    lrs = []
    for _ in range(2):
        for x, y in data(1):
            lrs.append([optimizer.param_groups[0]["lr"]])
            optimizer.zero_grad()
            loss: torch.Tensor = F.mse_loss(reference(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            result["lr_scheduler"]["scheduler"].step(float(loss.detach()))
    check(model, reference, lrs)
    assert len({lr for (lr,) in lrs}) > 1
    assert trainer.losses[-1] == pytest.approx(float(loss.detach()))


def test_a_list_of_dicts_with_two_optimizers() -> None:
    def configure(m: torch.nn.Sequential) -> Any:
        a, b = sgd(m[0].parameters()), torch.optim.Adam(m[2].parameters(), lr=0.01)
        return [
            {"optimizer": a, "lr_scheduler": {"scheduler": Sched.StepLR(a, 3), "interval": "step"}},
            {"optimizer": b, "lr_scheduler": Sched.ExponentialLR(b, gamma=0.7)},
        ], [a, b]

    def step(result: Any, steps: int, epoch: int, val: float) -> None:
        if epoch < 0:
            result[0]["lr_scheduler"]["scheduler"].step()
        else:
            result[1]["lr_scheduler"].step()

    model = Model(configure)
    trainer = fit(model, 3)
    reference, lrs = plain(configure, 3, step)
    check(model, reference, lrs)
    assert len(trainer.optimization.optimizers) == 2
    assert [c.interval for c in trainer.optimization.configs] == ["step", "epoch"]


def plateau_on(metric: str, **extra: Any) -> Configure:
    def configure(m: torch.nn.Sequential) -> Any:
        o = sgd(m.parameters())
        s = Sched.ReduceLROnPlateau(o, mode="max", factor=0.5, patience=0)
        return {"optimizer": o, "lr_scheduler": {"scheduler": s, "monitor": metric, **extra}}, [o]

    return configure


def test_a_missing_monitored_metric_raises_when_strict() -> None:
    with pytest.raises(MisconfigurationError) as error:
        fit(Model(plateau_on("val_acc")), 2)
    assert "'val_acc'" in str(error.value) and "'val_loss'" in str(error.value)


def test_a_missing_monitored_metric_warns_once_when_not_strict() -> None:
    model = Model(plateau_on("val_acc", strict=False))
    with pytest.warns(RuntimeWarning, match="val_acc") as record:
        trainer = fit(model, 3)
    assert len([w for w in record if "val_acc" in str(w.message)]) == 1
    assert trainer.optimization.optimizers[0].param_groups[0]["lr"] == 0.1  # never stepped


@pytest.mark.parametrize(
    ("entry", "named"),
    [
        ({"intervall": "step"}, "intervall"),
        ({"interval": "batch"}, "'batch'"),
        ({"frequency": 0}, "frequency=0"),
        ({"strict": "yes"}, "strict='yes'"),
    ],
)
def test_bad_scheduler_dicts_are_refused_naming_the_key(entry: dict[str, Any], named: str) -> None:
    def configure(m: torch.nn.Sequential) -> Any:
        o = sgd(m.parameters())
        return {"optimizer": o, "lr_scheduler": {"scheduler": Sched.StepLR(o, 1), **entry}}, [o]

    with pytest.raises(MisconfigurationError, match=named):
        fit(Model(configure), 1)


def test_reduce_on_plateau_without_a_monitor_and_bad_optimizer_keys_are_refused() -> None:
    def plateau(m: torch.nn.Sequential) -> Any:
        o = sgd(m.parameters())
        return {"optimizer": o, "lr_scheduler": Sched.ReduceLROnPlateau(o)}, [o]

    with pytest.raises(MisconfigurationError, match="ReduceLROnPlateau needs"):
        fit(Model(plateau), 1)

    def frequencies(m: torch.nn.Sequential) -> Any:
        o = sgd(m.parameters())
        return [{"optimizer": o, "frequency": 2}], [o]

    with pytest.raises(MisconfigurationError, match="frequency"):
        fit(Model(frequencies), 1)


def test_step_scheduler_state_resumes_from_a_checkpoint(tmp_path: Path) -> None:
    def configure(m: torch.nn.Sequential) -> Any:
        o = sgd(m.parameters())
        s = Sched.StepLR(o, step_size=3, gamma=0.5)
        return {"optimizer": o, "lr_scheduler": {"scheduler": s, "interval": "step"}}, [o]

    straight = Model(configure)
    fit(straight, 3)
    first = Model(configure)
    trainer = fit(first, 2)
    trainer.save_checkpoint(tmp_path / "two.ckpt")
    resumed = Model(configure)
    fit(resumed, 3, resume_from_checkpoint=str(tmp_path / "two.ckpt"))
    assert resumed.lrs == straight.lrs[8:]
    for ours, theirs in zip(resumed.parameters(), straight.parameters(), strict=True):
        assert torch.equal(ours, theirs)
