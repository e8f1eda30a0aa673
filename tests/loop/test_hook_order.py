"""The hooks a fit calls, in Lightning 1.0's order (DESIGN.md, "The training loop"; within a
batch the run order of research/lightning-1.0-loop.md): callbacks before the model for the
same hook, the sanity check before on_train_start, training_epoch_end then validation before
on_train_epoch_end; and the one-edit-away warning.

A model and a callback record every call; the expected sequence is written out here from
the design, not read from the loop."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage

TRAIN_BATCHES = 3
VAL_BATCHES = 2

#: The callback hooks (cardcage.Callback's names), with the arguments after (trainer, module).
CALLBACK_HOOKS = (
    "on_init_start",
    "on_init_end",
    "setup",
    "on_fit_start",
    "on_pretrain_routine_start",
    "on_pretrain_routine_end",
    "on_train_start",
    "on_sanity_check_start",
    "on_sanity_check_end",
    "on_epoch_start",
    "on_train_epoch_start",
    "on_batch_start",
    "on_train_batch_start",
    "on_before_zero_grad",
    "on_after_backward",
    "on_batch_end",
    "on_train_batch_end",
    "on_validation_start",
    "on_validation_epoch_start",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_validation_epoch_end",
    "on_validation_end",
    "on_train_epoch_end",
    "on_epoch_end",
    "on_train_end",
    "on_fit_end",
    "teardown",
)


def loaders() -> tuple[DataLoader[Any], DataLoader[Any]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * TRAIN_BATCHES, 3, generator=g)
    v = torch.randn(4 * VAL_BATCHES, 3, generator=g)
    train = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    val = DataLoader(TensorDataset(v, v.sum(1, keepdim=True)), batch_size=4)
    return train, val


class Recording:
    """Every model hook of DESIGN.md's list, each recording ``("model", name)``."""

    events: list[tuple[str, str]]
    epoch_outputs: list[list[Any]]
    step_losses: list[float]

    def setup_recording(self, events: list[tuple[str, str]]) -> None:
        self.events = events
        self.epoch_outputs = []
        self.step_losses = []

    def _rec(self, name: str) -> None:
        self.events.append(("model", name))

    def setup(self, stage: str) -> None:
        self._rec(f"setup:{stage}")

    def on_fit_start(self) -> None:
        self._rec("on_fit_start")

    def on_pretrain_routine_start(self) -> None:
        self._rec("on_pretrain_routine_start")

    def on_pretrain_routine_end(self) -> None:
        self._rec("on_pretrain_routine_end")

    def on_train_start(self) -> None:
        self._rec("on_train_start")

    def on_epoch_start(self) -> None:
        self._rec("on_epoch_start")

    def on_train_epoch_start(self) -> None:
        self._rec("on_train_epoch_start")

    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int) -> None:
        self._rec("on_train_batch_start")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._rec("training_step")
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)  # type: ignore[attr-defined]
        self.step_losses.append(float(loss.detach()))
        return loss

    def training_step_end(self, output: Any) -> Any:
        self._rec("training_step_end")
        return output

    def on_before_zero_grad(self, optimizer: Any) -> None:
        self._rec("on_before_zero_grad")

    def backward(self, loss: torch.Tensor, optimizer: Any, optimizer_idx: int) -> None:
        self._rec("backward")
        loss.backward()

    def on_after_backward(self) -> None:
        self._rec("on_after_backward")

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
        self._rec("optimizer_step")
        optimizer.step(closure=optimizer_closure)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int, idx: int) -> None:
        self._rec("on_train_batch_end")

    def training_epoch_end(self, outputs: list[Any]) -> None:
        self._rec("training_epoch_end")
        self.epoch_outputs.append(list(outputs))

    def on_validation_epoch_start(self) -> None:
        self._rec("on_validation_epoch_start")

    def on_validation_batch_start(self, batch: Any, batch_idx: int, idx: int) -> None:
        self._rec("on_validation_batch_start")

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._rec("validation_step")
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)  # type: ignore[attr-defined]

    def validation_step_end(self, output: Any) -> Any:
        self._rec("validation_step_end")
        return output

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, i: int) -> None:
        self._rec("on_validation_batch_end")

    def validation_epoch_end(self, outputs: list[Any]) -> None:
        self._rec("validation_epoch_end")

    def on_validation_epoch_end(self) -> None:
        self._rec("on_validation_epoch_end")

    def on_train_epoch_end(self, outputs: Any) -> None:
        self._rec("on_train_epoch_end")

    def on_epoch_end(self) -> None:
        self._rec("on_epoch_end")

    def on_train_end(self) -> None:
        self._rec("on_train_end")

    def on_fit_end(self) -> None:
        self._rec("on_fit_end")

    def teardown(self, stage: str) -> None:
        self._rec(f"teardown:{stage}")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self._rec("configure_optimizers")
        return torch.optim.SGD(self.parameters(), lr=0.05)  # type: ignore[attr-defined]


class RecordingModule(Recording, cardcage.Module):
    def __init__(self, events: list[tuple[str, str]]):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.setup_recording(events)


class RecordingPlain(Recording, torch.nn.Module):
    """The same hooks on a plain ``nn.Module`` (no cardcage base class)."""

    def __init__(self, events: list[tuple[str, str]]):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.setup_recording(events)


class RecordingCallback(cardcage.Callback):
    def __init__(self, events: list[tuple[str, str]]):
        self.events = events


def _callback_hook(name: str) -> Any:
    def hook(self: RecordingCallback, trainer: Any, *args: Any) -> None:
        stage = f":{args[1]}" if name in ("setup", "teardown") else ""
        self.events.append(("cb", name + stage))

    hook.__name__ = name
    return hook


for _name in CALLBACK_HOOKS:  # defined on the class itself: the loop calls overridden hooks
    setattr(RecordingCallback, _name, _callback_hook(_name))


# -- the expected sequence, from DESIGN.md -------------------------------------------------

MODEL_AND_CALLBACK = set(CALLBACK_HOOKS) - {
    "on_init_start",
    "on_init_end",
    "on_sanity_check_start",
    "on_sanity_check_end",
    "on_batch_start",
    "on_batch_end",
    "on_validation_start",
    "on_validation_end",
}


def hook(name: str) -> list[tuple[str, str]]:
    """A hook both define: the callback's call, then the model's."""
    assert name in MODEL_AND_CALLBACK, name
    return [("cb", name), ("model", name)]


def validation(batches: int) -> list[tuple[str, str]]:
    seq = [("cb", "on_validation_start"), *hook("on_validation_epoch_start")]
    for _ in range(batches):
        seq += [
            *hook("on_validation_batch_start"),
            ("model", "validation_step"),
            ("model", "validation_step_end"),
            *hook("on_validation_batch_end"),
        ]
    seq += [
        ("model", "validation_epoch_end"),
        *hook("on_validation_epoch_end"),
        ("cb", "on_validation_end"),
    ]
    return seq


def train_batch() -> list[tuple[str, str]]:
    return [
        ("cb", "on_batch_start"),
        *hook("on_train_batch_start"),
        ("model", "training_step"),
        ("model", "training_step_end"),
        ("model", "backward"),
        *hook("on_after_backward"),
        ("model", "optimizer_step"),
        *hook("on_before_zero_grad"),  # Lightning 1.0 zeroes after the step
        ("cb", "on_batch_end"),
        *hook("on_train_batch_end"),
    ]


def expected(epochs: int, sanity_batches: int) -> list[tuple[str, str]]:
    seq = [("cb", "on_init_start"), ("cb", "on_init_end")]  # in the Trainer's constructor
    seq += [("cb", "setup:fit"), ("model", "setup:fit")]
    seq += hook("on_fit_start")
    seq += hook("on_pretrain_routine_start") + hook("on_pretrain_routine_end")
    if sanity_batches:
        seq += [("cb", "on_sanity_check_start"), *validation(sanity_batches)]
        seq += [("cb", "on_sanity_check_end")]
    seq += hook("on_train_start")
    for _ in range(epochs):
        seq += hook("on_epoch_start") + hook("on_train_epoch_start")
        for _ in range(TRAIN_BATCHES):
            seq += train_batch()
        seq += [("model", "training_epoch_end")]
        seq += validation(VAL_BATCHES)
        seq += hook("on_train_epoch_end") + hook("on_epoch_end")
    seq += hook("on_train_end") + hook("on_fit_end")
    seq += [("cb", "teardown:fit"), ("model", "teardown:fit")]
    return seq


def fit(model_class: type, **flags: Any) -> tuple[list[tuple[str, str]], Any, Any]:
    events: list[tuple[str, str]] = []
    model = model_class(events)
    trainer = cardcage.Trainer(callbacks=[RecordingCallback(events)], progress_bar=False, **flags)
    train, val = loaders()
    trainer.fit(model, train, val)
    # configure_optimizers' place (after setup) is test_setup_runs_before_configure_optimizers'
    hooks_only = [e for e in events if e != ("model", "configure_optimizers")]
    return hooks_only, model, trainer


def first_difference(got: list[Any], want: list[Any]) -> str:
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"call {i}: got {a}, expected {b}; before it: {want[max(0, i - 4) : i]}"
    return f"lengths differ: got {len(got)}, expected {len(want)}"


@pytest.mark.parametrize("model_class", [RecordingModule, RecordingPlain])
def test_hooks_run_in_lightning_order_callbacks_first(model_class: type) -> None:
    """Two epochs, one sanity batch: the exact sequence, for cardcage.Module and a plain
    nn.Module alike."""
    events, _, _ = fit(model_class, max_epochs=2, num_sanity_val_steps=1)
    want = expected(epochs=2, sanity_batches=1)
    assert events == want, first_difference(events, want)


def test_hook_call_counts() -> None:
    """Per-hook counts of the same run (a check independent of the sequence's layout)."""
    events, _, _ = fit(RecordingModule, max_epochs=2, num_sanity_val_steps=1)
    count = {
        name: sum(1 for who, n in events if who == "model" and n == name) for _, name in events
    }
    steps = 2 * TRAIN_BATCHES
    assert count["training_step"] == steps
    assert count["optimizer_step"] == steps
    assert count["backward"] == steps
    assert count["on_train_batch_end"] == steps
    assert count["validation_step"] == 1 + 2 * VAL_BATCHES
    assert count["validation_epoch_end"] == 1 + 2
    assert count["training_epoch_end"] == 2
    assert count["on_train_epoch_end"] == 2
    assert count["on_fit_start"] == count["on_train_start"] == count["on_fit_end"] == 1
    assert events.count(("cb", "on_sanity_check_start")) == 1
    assert events.count(("cb", "on_validation_end")) == 3
    assert events.count(("cb", "on_batch_start")) == steps


def test_default_runs_no_sanity_check_and_one_validation_epoch_end_per_epoch() -> None:
    """num_sanity_val_steps defaults to 0: validation_epoch_end runs once per validated
    epoch and no sanity hook runs."""
    events, _, _ = fit(RecordingModule, max_epochs=3)
    assert events.count(("model", "validation_epoch_end")) == 3
    assert events.count(("model", "validation_step")) == 3 * VAL_BATCHES
    assert ("cb", "on_sanity_check_start") not in events
    assert events == expected(epochs=3, sanity_batches=0), first_difference(
        events, expected(epochs=3, sanity_batches=0)
    )


def test_training_epoch_end_receives_each_steps_output() -> None:
    """One output per training step of the epoch, each the step's loss (detached)."""
    _, model, _ = fit(RecordingModule, max_epochs=2)
    assert [len(o) for o in model.epoch_outputs] == [TRAIN_BATCHES, TRAIN_BATCHES]
    got = [float(out["loss"]) for epoch in model.epoch_outputs for out in epoch]
    assert got == model.step_losses
    assert not any(out["loss"].requires_grad for epoch in model.epoch_outputs for out in epoch)


# -- the one-edit-away warning -------------------------------------------------------------


class Tiny(cardcage.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return (self.w - batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def tiny_loader() -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.ones(4, 1)), batch_size=2)


def near_miss_warnings(model: torch.nn.Module, fits: int = 1) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(fits):
            cardcage.Trainer(progress_bar=False).fit(model, tiny_loader())
    return [str(w.message) for w in caught if "one edit away" in str(w.message)]


def test_a_method_one_edit_from_a_hook_warns_once_naming_the_hook() -> None:
    class Typos(Tiny):
        def on_train_epoch_ends(self, outputs: Any) -> None:  # one insertion
            pass

        def validation_epoch_ed(self, outputs: Any) -> None:  # one deletion
            pass

    said = near_miss_warnings(Typos(), fits=2)
    assert len(said) == 2, said  # one per misspelt method, over two fits
    assert any("on_train_epoch_ends" in s and "'on_train_epoch_end'" in s for s in said), said
    assert any("validation_epoch_ed" in s and "'validation_epoch_end'" in s for s in said), said


def test_a_plain_module_with_a_near_miss_warns_too() -> None:
    class PlainTypo(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return (self.w - batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_train_epoch_ends(self, outputs: Any) -> None:
            pass

    said = near_miss_warnings(PlainTypo())
    assert len(said) == 1 and "'on_train_epoch_end'" in said[0], said


def test_a_swap_of_neighbouring_letters_warns() -> None:
    class Swapped(Tiny):
        def on_fit_strat(self) -> None:
            pass

    said = near_miss_warnings(Swapped())
    assert len(said) == 1 and "'on_fit_start'" in said[0], said


def test_private_names_real_hooks_and_far_names_do_not_warn() -> None:
    class Fine(Tiny):
        def _on_train_epoch_ends(self) -> None:  # private
            pass

        def on_train_epoch_end(self, outputs: Any) -> None:  # a real hook
            pass

        def training_epoch_end(self, outputs: Any) -> None:  # a real hook
            pass

        def validation_summary(self) -> None:  # far from any hook
            pass

    assert near_miss_warnings(Fine()) == []


class EpochSeen(cardcage.Callback):
    """Records trainer.current_epoch in the hooks of each epoch."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.seen.append(("on_train_epoch_start", trainer.current_epoch))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.seen.append(("on_train_batch_end", trainer.current_epoch))

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.seen.append(("on_validation_batch_end", trainer.current_epoch))

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self.seen.append(("on_validation_end", trainer.current_epoch))

    def on_train_epoch_end(self, trainer: Any, pl_module: Any, outputs: Any) -> None:
        self.seen.append(("on_train_epoch_end", trainer.current_epoch))

    def on_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.seen.append(("on_epoch_end", trainer.current_epoch))


def test_current_epoch_is_the_epoch_being_run_until_its_last_hook() -> None:
    """Lightning 1.0: trainer.current_epoch is the epoch trained through its validation,
    on_train_epoch_end and on_epoch_end (a callback stopping "at epoch 0", or a checkpoint
    named epoch=0 after the first epoch, reads it there)."""
    callback = EpochSeen()
    model = RecordingModule([])
    train, val = loaders()
    cardcage.Trainer(max_epochs=2, callbacks=[callback], progress_bar=False).fit(model, train, val)
    per_epoch = [
        "on_train_epoch_start",
        *["on_train_batch_end"] * TRAIN_BATCHES,
        *["on_validation_batch_end"] * VAL_BATCHES,
        "on_validation_end",
        "on_train_epoch_end",
        "on_epoch_end",
    ]
    assert callback.seen == [(name, epoch) for epoch in (0, 1) for name in per_epoch]


class BuiltInSetup(cardcage.Module):
    """Lightning 1.0's documented use of setup: build layers there ("build models
    dynamically"); configure_optimizers, called after setup, optimizes them."""

    def setup(self, stage: str) -> None:
        self.layer = torch.nn.Linear(3, 1)

    def on_train_start(self) -> None:
        self.at_start = copy.deepcopy(self.layer.state_dict())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_setup_runs_before_configure_optimizers_so_layers_built_there_train() -> None:
    events: list[tuple[str, str]] = []
    model = RecordingModule(events)
    train, _ = loaders()
    cardcage.Trainer(callbacks=[RecordingCallback(events)], progress_bar=False).fit(model, train)
    assert events[2:6] == [
        ("cb", "setup:fit"),
        ("model", "setup:fit"),
        ("model", "configure_optimizers"),
        ("cb", "on_fit_start"),
    ], events[:6]
    model = BuiltInSetup()
    train, _ = loaders()
    trainer = cardcage.Trainer(max_epochs=1, progress_bar=False)
    trainer.fit(model, train)
    assert trainer.global_step == TRAIN_BATCHES
    assert not torch.equal(model.layer.weight, model.at_start["weight"])


class EndsEpochAtBatch1(cardcage.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.steps: list[int] = []

    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int) -> Any:
        return -1 if batch_idx == 1 else None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps.append(batch_idx)
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class BatchStartWatcher(cardcage.Callback):
    def on_train_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        pass


@pytest.mark.parametrize("with_callback", [False, True])
def test_on_train_batch_start_returning_minus_one_ends_the_epoch(with_callback: bool) -> None:
    """Lightning 1.0: the model's -1 ends the epoch, whether or not a callback also
    defines the hook (a callback returns nothing)."""
    model = EndsEpochAtBatch1()
    train, _ = loaders()
    callbacks = [BatchStartWatcher()] if with_callback else []
    trainer = cardcage.Trainer(max_epochs=2, callbacks=callbacks, progress_bar=False)
    trainer.fit(model, train)
    assert model.steps == [0, 0]
    assert trainer.global_step == 2
