"""The Callback base class: every hook the loop calls exists as a no-op with Lightning 1.0's
arguments, and ``overridden`` picks out only the hooks a callback defines."""

from __future__ import annotations

import inspect
from typing import Any

import cardcage.callbacks
from cardcage.callbacks import (
    CALLBACK_HOOKS,
    INIT_HOOKS,
    STATE_HOOKS,
    Callback,
    EarlyStopping,
    ModelCheckpoint,
    ignored_hooks,
    overridden,
)

#: The arguments after (trainer, pl_module) that LOOP_API gives each hook with more.
EXTRA = {
    "on_train_batch_start": ["batch", "batch_idx", "dataloader_idx"],
    "on_validation_batch_start": ["batch", "batch_idx", "dataloader_idx"],
    "on_test_batch_start": ["batch", "batch_idx", "dataloader_idx"],
    "on_train_batch_end": ["outputs", "batch", "batch_idx", "dataloader_idx"],
    "on_validation_batch_end": ["outputs", "batch", "batch_idx", "dataloader_idx"],
    "on_test_batch_end": ["outputs", "batch", "batch_idx", "dataloader_idx"],
    "on_train_epoch_end": ["outputs"],
    "on_before_zero_grad": ["optimizer"],
    "setup": ["stage"],
    "teardown": ["stage"],
}


def test_every_hook_is_a_no_op_with_lightnings_arguments() -> None:
    callback = Callback()
    assert len(set(CALLBACK_HOOKS)) == len(CALLBACK_HOOKS) == 32
    for name in CALLBACK_HOOKS + INIT_HOOKS:
        parameters = list(inspect.signature(getattr(Callback, name)).parameters)
        wanted = ["trainer"] if name in INIT_HOOKS else ["trainer", "pl_module"]
        assert parameters == ["self", *wanted, *EXTRA.get(name, [])], name
        arguments = [None] * (len(parameters) - 1)
        assert getattr(callback, name)(*arguments) is None
        assert not overridden(callback, name)
    assert callback.on_save_checkpoint(None, None) is None
    assert callback.state_key == "Callback"


def test_overridden_names_only_what_a_callback_defines() -> None:
    class Counting(Callback):
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            pass

        def on_save_checkpoint(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
            return {}

    class Further(Counting):
        pass

    callback = Further()
    callback.on_epoch_end = lambda trainer, pl_module: None  # type: ignore[method-assign]
    wanted = {"on_fit_start", "on_epoch_end", "on_save_checkpoint"}
    hooks = CALLBACK_HOOKS + STATE_HOOKS
    assert {name for name in hooks if overridden(callback, name)} == wanted
    assert callback.state_key.endswith("Further")
    assert {name for name in hooks if overridden(ModelCheckpoint(), name)} == {
        "on_epoch_end",
        *STATE_HOOKS,
    }
    assert {name for name in hooks if overridden(EarlyStopping("loss"), name)} == {
        "on_train_epoch_end",
        *STATE_HOOKS,
    }


def test_hooks_cardcage_never_calls_are_found_and_not_defined_by_the_base() -> None:
    """The Trainer refuses a callback that defines on_keyboard_interrupt: the base class
    must not define it, or every callback would be refused."""

    class Old(Callback):
        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            pass

        def on_keyboard_interrupt(self, trainer: Any, pl_module: Any) -> None:
            pass

    assert ignored_hooks(Old()) == ["on_keyboard_interrupt"]
    assert ignored_hooks(Callback()) == ignored_hooks(ModelCheckpoint()) == []


def test_the_package_imports_nothing_of_the_trainer() -> None:
    source = inspect.getsource(cardcage.callbacks.base)
    assert "cardcage.train" not in source
