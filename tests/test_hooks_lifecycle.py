"""The lifecycle hooks (``cardcage_setup`` and ``cardcage_train`` in the calling process,
``cardcage_setup_process`` and ``cardcage_teardown_process`` in each training process),
wrapped by an in-process plugin: it sees them in order, sees their exceptions, and can
replace what ``fit`` returns, without subclassing a backend."""

from __future__ import annotations

import os
import types
from collections.abc import Callable, Generator, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage
from cardcage.plugins import manager as plugins

STEPS = 4


def loader() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(8 * STEPS, 3, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)


class Model(torch.nn.Module):
    def __init__(self, events: list[Any], fail_at: int | None = None):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.events = events
        self.fail_at = fail_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == self.fail_at:
            raise ValueError(f"step {batch_idx} failed")
        self.events.append("step")
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.events.append("configure_optimizers")
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Observer:
    """Wraps both lifecycle hooks and records what it sees."""

    def __init__(self, replace: Any = None, fail_setup: bool = False):
        self.events: list[Any] = []
        self.replace = replace
        self.fail_setup = fail_setup
        self.errors: list[BaseException] = []

    @cardcage.hookimpl(wrapper=True)
    def cardcage_setup(
        self, trainer: cardcage.Trainer, accelerator: cardcage.Accelerator
    ) -> Generator[None, Any, Any]:
        self.events.append(("setup", accelerator.name))
        return (yield)

    @cardcage.hookimpl(wrapper=True)
    def cardcage_setup_process(
        self, trainer: cardcage.Trainer, accelerator: cardcage.Accelerator
    ) -> Generator[None, Any, Any]:
        self.events.append(("setup:before", accelerator.name, len(trainer.optimization.optimizers)))
        if self.fail_setup:
            raise RuntimeError("refused by the plugin")
        result = yield
        self.events.append(("setup:after", result))
        return result

    @cardcage.hookimpl(wrapper=True)
    def cardcage_teardown_process(
        self, trainer: cardcage.Trainer, accelerator: cardcage.Accelerator
    ) -> Generator[None, Any, Any]:
        result = yield
        self.events.append("teardown")
        return result

    @cardcage.hookimpl(wrapper=True)
    def cardcage_train(
        self, trainer: cardcage.Trainer, accelerator: cardcage.Accelerator
    ) -> Generator[None, Any, Any]:
        assert accelerator is trainer.accelerator
        self.events.append(("train:before", trainer.global_step))
        try:
            result = yield
        except BaseException as error:
            self.errors.append(error)
            self.events.append("train:error")
            raise
        self.events.append(("train:after", trainer.global_step, result))
        return self.replace if self.replace is not None else result


@pytest.fixture
def register() -> Iterator[Callable[[object, str], None]]:
    """Register in-process plugins for one test; they are unregistered afterwards."""
    names: list[str] = []

    def add(plugin: object, name: str) -> None:
        names.append(name)
        plugins.register(plugin, name=name)

    try:
        yield add
    finally:
        for name in names:
            plugins.unregister(name)


def test_wrappers_see_setup_and_training_in_order(
    register: Callable[[object, str], None],
) -> None:
    observer = Observer()
    register(observer, "observer")
    model = Model(observer.events)
    trainer = cardcage.Trainer(max_epochs=2, progress_bar=False)
    result = trainer.fit(model, loader())

    assert result is None  # what the cpu backend returns
    assert observer.events == [
        ("setup", "cpu"),  # in the calling process, once, before train
        ("train:before", 0),
        ("setup:before", "cpu", 0),  # the training process's setup, before the optimizers
        ("setup:after", True),
        "configure_optimizers",
        *["step"] * 2 * STEPS,
        "teardown",
        ("train:after", 2 * STEPS, None),
    ]
    assert trainer.global_step == 2 * STEPS


def test_a_wrapper_replaces_what_fit_returns(register: Callable[[object, str], None]) -> None:
    summary = {"trained": True}
    observer = Observer(replace=summary)
    register(observer, "observer")
    trainer = cardcage.Trainer(progress_bar=False)
    assert trainer.fit(Model(observer.events), loader()) is summary
    assert trainer.results is summary
    assert observer.events.count("step") == STEPS  # training still ran


def test_errors_in_training_reach_the_wrapper_and_the_caller(
    register: Callable[[object, str], None],
) -> None:
    observer = Observer()
    register(observer, "observer")
    with pytest.raises(ValueError, match="step 2 failed") as raised:
        cardcage.Trainer(progress_bar=False).fit(Model(observer.events, fail_at=2), loader())
    assert observer.errors == [raised.value]
    assert observer.events[-4:] == ["step", "step", "teardown", "train:error"]


def test_an_error_raised_by_a_setup_wrapper_stops_the_run(
    register: Callable[[object, str], None],
) -> None:
    observer = Observer(fail_setup=True)
    register(observer, "observer")
    model = Model(observer.events)
    with pytest.raises(RuntimeError, match="refused by the plugin"):
        cardcage.Trainer(progress_bar=False).fit(model, loader())
    assert "configure_optimizers" not in observer.events
    assert "step" not in observer.events
    assert observer.events[-2:] == ["teardown", "train:error"]  # torn down all the same


def test_a_plain_implementation_takes_over_training(
    register: Callable[[object, str], None],
) -> None:
    """A non-wrapper ``cardcage_train`` runs before the core's and its result wins."""
    calls: list[str] = []

    @cardcage.hookimpl
    def cardcage_train(trainer: cardcage.Trainer, accelerator: cardcage.Accelerator) -> str:
        calls.append(accelerator.name)
        return "dry run"

    module = types.ModuleType("dry_run_plugin")
    module.cardcage_train = cardcage_train  # type: ignore[attr-defined]
    register(module, "dry_run")
    events: list[Any] = []
    model = Model(events)
    before = model.layer.weight.detach().clone()
    trainer = cardcage.Trainer(progress_bar=False)
    assert trainer.fit(model, loader()) == "dry run"
    assert calls == ["cpu"]
    assert events == []  # the core's training never ran
    assert torch.equal(model.layer.weight, before)


def test_setup_wrappers_also_run_for_validate(register: Callable[[object, str], None]) -> None:
    observer = Observer()
    register(observer, "observer")
    trainer = cardcage.Trainer(progress_bar=False)
    metrics = trainer.validate(Model(observer.events), loader())
    assert [set(d) for d in metrics] == [{"val_loss"}]
    assert observer.events == [("setup:before", "cpu", 0), ("setup:after", True)]


class SetupAndTrain(cardcage.Accelerator):
    """A backend whose ``train`` never calls the core's loop."""

    name = "setup_and_train"
    calls: list[tuple[str, int]] = []

    def setup(self, trainer: cardcage.Trainer) -> None:
        self.calls.append(("setup", os.getpid()))

    def train(self, trainer: cardcage.Trainer) -> str:
        self.calls.append(("train", os.getpid()))
        return "trained elsewhere"


def test_fit_calls_setup_then_train_once_each_in_the_calling_process(
    register: Callable[[object, str], None],
) -> None:
    module = types.ModuleType("setup_and_train_plugin")
    module.cardcage_accelerators = cardcage.hookimpl(lambda: [SetupAndTrain])  # type: ignore[attr-defined]
    register(module, "setup_and_train")
    SetupAndTrain.calls.clear()
    trainer = cardcage.Trainer(distributed_backend="setup_and_train", progress_bar=False)
    assert trainer.fit(Model([]), loader()) == "trained elsewhere"
    assert SetupAndTrain.calls == [("setup", os.getpid()), ("train", os.getpid())]


def test_an_unregistered_plugin_is_no_longer_called(
    register: Callable[[object, str], None],
) -> None:
    observer = Observer()
    register(observer, "observer")
    plugins.unregister("observer")
    cardcage.Trainer(progress_bar=False).fit(Model([]), loader())
    assert observer.events == []
