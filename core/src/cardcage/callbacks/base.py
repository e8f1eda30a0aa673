"""``cardcage.Callback``: Lightning 1.0's callback hooks, each a no-op to override.

The loop calls a hook on every callback that overrides it, in ``trainer.callbacks`` order,
before the model's hook of the same name, in every training process. :data:`CALLBACK_HOOKS`
names every hook it may call; :func:`overridden` tells it, cheaply, which callbacks to call.

Hooks take ``trainer`` and ``pl_module`` typed ``Any``: a subclass may annotate them as
narrowly as it likes (``cardcage.Trainer``, its own module class) without breaking mypy's
override rules. :class:`TrainerView` lists what the shipped callbacks read of a trainer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

#: Every hook the loop may call, each as ``hook(trainer, pl_module, ...)``.
CALLBACK_HOOKS: tuple[str, ...] = (
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
    "on_test_start",
    "on_test_epoch_start",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_test_epoch_end",
    "on_test_end",
)

#: The hooks the Trainer's constructor calls, each as ``hook(trainer)``.
INIT_HOOKS: tuple[str, ...] = ("on_init_start", "on_init_end")

#: The state hooks: ``on_save_checkpoint(trainer, pl_module) -> dict | None`` when a
#: checkpoint is gathered, ``on_load_checkpoint(state)`` on resume.
STATE_HOOKS: tuple[str, ...] = ("on_save_checkpoint", "on_load_checkpoint")

#: Lightning 1.0 callback hooks that cardcage never calls (so :class:`Callback` does not
#: define them): the Trainer refuses a callback that does, naming the hook.
#: :func:`ignored_hooks` finds them.
NOT_CALLED: tuple[str, ...] = ("on_keyboard_interrupt",)


class TrainerView(Protocol):
    """What the shipped callbacks read of a trainer (see docs/training-loop.md, "Callbacks")."""

    callback_metrics: Mapping[str, torch.Tensor]
    current_epoch: int
    global_step: int
    global_rank: int
    is_global_zero: bool
    sanity_checking: bool
    should_stop: bool
    validated_this_epoch: bool
    default_root_dir: str | None
    flags: Any
    logger: Any
    accelerator: Any

    def save_checkpoint(self, path: str) -> None: ...


class Callback:
    """Base class of a callback: override the hooks you need; the rest cost nothing.

    Lightning 1.0's hook names and signatures; ``trainer`` is the :class:`cardcage.Trainer`
    of this training process and ``pl_module`` the user's module (not a backend's wrapper).
    """

    @property
    def state_key(self) -> str:
        """The key of this callback's state in a checkpoint's ``"callbacks"`` dict."""
        return type(self).__qualname__

    # -- fit ------------------------------------------------------------------------------

    def on_init_start(self, trainer: Any) -> None:
        """The Trainer's constructor has checked its flags (``trainer`` only)."""

    def on_init_end(self, trainer: Any) -> None:
        """The Trainer's constructor is about to return (``trainer`` only)."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """A stage (``"fit"``) begins in this process, before ``on_fit_start``."""

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """A stage (``"fit"``) ends in this process, after ``on_fit_end``."""

    def on_pretrain_routine_start(self, trainer: Any, pl_module: Any) -> None:
        """After ``on_fit_start``, before the sanity check."""

    def on_pretrain_routine_end(self, trainer: Any, pl_module: Any) -> None:
        """After ``on_pretrain_routine_start``, before the sanity check."""

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """``fit`` begins, after the resume (callback states are already loaded)."""

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """``fit`` ends."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Training begins (after the sanity check, if any)."""

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Training ends."""

    def on_sanity_check_start(self, trainer: Any, pl_module: Any) -> None:
        """The sanity validation (``num_sanity_val_steps``) begins."""

    def on_sanity_check_end(self, trainer: Any, pl_module: Any) -> None:
        """The sanity validation ends."""

    # -- epochs and batches ---------------------------------------------------------------

    def on_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """A training epoch begins (before ``on_train_epoch_start``)."""

    def on_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """A training epoch ends (after ``on_train_epoch_end``)."""

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """A training epoch begins."""

    def on_train_epoch_end(self, trainer: Any, pl_module: Any, outputs: Any) -> None:
        """A training epoch ends, after its validation if one ran: this epoch's training and
        validation metrics are in ``trainer.callback_metrics``."""

    def on_batch_start(self, trainer: Any, pl_module: Any) -> None:
        """A training batch begins (before ``on_train_batch_start``)."""

    def on_batch_end(self, trainer: Any, pl_module: Any) -> None:
        """A training batch ends (before ``on_train_batch_end``)."""

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int
    ) -> None:
        """A training batch begins."""

    def on_train_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        """A training batch ends, after its optimizer step."""

    def on_before_zero_grad(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """Before the gradients of ``optimizer`` are zeroed, after its step."""

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        """After backward, before clipping and the optimizer step."""

    # -- validation -----------------------------------------------------------------------

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        """A validation (or the sanity check's) begins."""

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        """A validation ends."""

    def on_validation_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """A validation epoch begins."""

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """A validation epoch ends, its metrics reduced."""

    def on_validation_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int
    ) -> None:
        """A validation batch begins."""

    def on_validation_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        """A validation batch ends."""

    # -- test -----------------------------------------------------------------------------

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        """A test begins."""

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        """A test ends."""

    def on_test_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """A test epoch begins."""

    def on_test_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """A test epoch ends, its metrics reduced."""

    def on_test_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int
    ) -> None:
        """A test batch begins."""

    def on_test_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        """A test batch ends."""

    # -- state ----------------------------------------------------------------------------

    def on_save_checkpoint(self, trainer: Any, pl_module: Any) -> dict[str, Any] | None:
        """This callback's state for a checkpoint (None: nothing to keep).

        Called in every training process when a checkpoint is gathered; the trainer stores
        it under ``checkpoint["callbacks"][self.state_key]``. Checkpoints are read with
        ``weights_only=True``: keep to plain values, containers of them, and tensors.
        """
        return None

    def on_load_checkpoint(self, state: dict[str, Any]) -> None:
        """Restore the state :meth:`on_save_checkpoint` returned (on resume, in every
        training process, before ``on_fit_start``)."""


def overridden(callback: Callback, name: str) -> bool:
    """Whether ``callback`` does something in hook ``name``: its class (or the instance
    itself) defines the hook other than as :class:`Callback`'s no-op.

    A callback that is not a :class:`Callback` (Lightning allowed duck typing) overrides
    every hook it has.
    """
    if name in getattr(callback, "__dict__", {}):  # set on the instance
        return True
    base = getattr(Callback, name, None)
    own = getattr(type(callback), name, None)
    return own is not None and own is not base


def ignored_hooks(callback: object) -> list[str]:
    """The Lightning 1.0 hooks in :data:`NOT_CALLED` that ``callback`` defines: the loop
    would never call them."""
    return [name for name in NOT_CALLED if callable(getattr(callback, name, None))]


def missing_metric(who: str, name: str, metrics: Mapping[str, Any]) -> str:
    """The message for a monitored metric that is not in ``trainer.callback_metrics``."""
    available = ", ".join(sorted(metrics)) or "none"
    return (
        f"{who}(monitor={name!r}): {name!r} is not in trainer.callback_metrics (available:"
        f" {available}). Log it with self.log({name!r}, value) in training_step,"
        " validation_step or their *_epoch_end, or monitor one of the available metrics."
    )


def validation_is_between(trainer: Any) -> bool:
    """Whether this epoch fell between two validations: it did not validate, though the fit
    validates (``check_val_every_n_epoch`` > 1 and this epoch not due).

    A monitored validation metric then still holds an earlier epoch's value: the shipped
    callbacks do not judge an epoch by it. When a due epoch did not validate, the fit has no
    validation (no loader, no ``validation_step``, ``limit_val_batches=0``), and every epoch
    is judged by its training metrics.
    """
    if trainer.validated_this_epoch:
        return False
    every = int(trainer.flags.check_val_every_n_epoch)
    return (int(trainer.current_epoch) + 1) % every != 0
