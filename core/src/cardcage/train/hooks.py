"""The hooks the loop calls on the model and on the callbacks, in Lightning 1.0's order
(docs/training-loop.md draws it), and the warning for a method one edit away from a hook.

A hook with nothing to call costs the loop one ``is None`` test: :meth:`Hooks.get` returns
``None`` for it, and the loop looks each up once per fit.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from cardcage.callbacks import CALLBACK_HOOKS, INIT_HOOKS, STATE_HOOKS, overridden

#: Hooks only a model has (the callbacks' are :data:`cardcage.callbacks.CALLBACK_HOOKS`,
#: which a model may define too, but for :data:`CALLBACK_ONLY`).
MODEL_ONLY = (
    "training_step",
    "training_step_end",
    "backward",
    "optimizer_step",
    "training_epoch_end",
    "validation_step",
    "validation_step_end",
    "validation_epoch_end",
    "test_step",
    "test_step_end",
    "test_epoch_end",
    "predict_step",
    "configure_optimizers",
    "train_dataloader",
    "val_dataloader",
    "test_dataloader",
    "predict_dataloader",
)

#: Hooks called on callbacks only (Lightning 1.0's base module lacked them).
CALLBACK_ONLY = (
    "on_init_start",
    "on_init_end",
    "on_batch_start",
    "on_batch_end",
    "on_validation_start",
    "on_validation_end",
    "on_test_start",
    "on_test_end",
    "on_sanity_check_start",
    "on_sanity_check_end",
)

#: Every hook name the loop may call, for the one-edit-away check.
ALL_HOOKS = frozenset(CALLBACK_HOOKS + INIT_HOOKS + STATE_HOOKS + MODEL_ONLY)


class Hooks:
    """The callables of each hook for one fit: the callbacks' (in list order, given
    ``(trainer, module, ...)``), then the model's."""

    def __init__(self, trainer: Any, model: torch.nn.Module, callbacks: Iterable[Any]):
        self._trainer = trainer
        self._model = model
        self._callbacks = list(callbacks)
        self._cache: dict[str, Callable[..., Any] | None] = {}

    def get(self, name: str) -> Callable[..., Any] | None:
        """One callable running every implementation of ``name``, or None when there is
        none."""
        if name in self._cache:
            return self._cache[name]
        calls: list[Callable[..., Any]] = [
            functools.partial(getattr(cb, name), self._trainer, self._model)
            for cb in self._callbacks
            if overridden(cb, name)
        ]
        own = getattr(self._model, name, None) if name not in CALLBACK_ONLY else None
        if callable(own):
            calls.append(own)
        found: Callable[..., Any] | None
        if not calls:
            found = None
        elif len(calls) == 1:
            found = calls[0]
        else:

            def found(*args: Any, **kwargs: Any) -> Any:
                # what the model's (last) implementation returns, as Lightning 1.0's
                # call_hook: on_train_batch_start's -1 ends the epoch
                returned = None
                for call in calls:
                    returned = call(*args, **kwargs)
                return returned

        self._cache[name] = found
        return found

    def __call__(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Call hook ``name`` (callbacks first, then the model) when anything defines it."""
        call = self.get(name)
        if call is not None:
            call(*args, **kwargs)


_warned: set[tuple[type, str]] = set()


def warn_near_misses(model: torch.nn.Module) -> None:
    """Warn once per class and name when a model method is one edit away from a hook
    (``on_train_epoch_ends``, ``validation_epoch_end_``): cardcage would never call it."""
    kind = type(model)
    own = {
        name
        for klass in kind.__mro__
        if klass.__module__.split(".")[0] not in ("torch", "cardcage", "builtins")
        for name, value in vars(klass).items()
        if callable(value) and not name.startswith("_")
    }
    for name in sorted(own - ALL_HOOKS):
        for hook in sorted(ALL_HOOKS):
            if _one_edit(name, hook) and (kind, name) not in _warned:
                _warned.add((kind, name))
                warnings.warn(
                    f"cardcage: {kind.__name__}.{name} is one edit away from the hook "
                    f"{hook!r}, which cardcage calls; it never calls {name!r}. Rename it "
                    f"{hook!r} if it is meant as that hook.",
                    UserWarning,
                    stacklevel=3,
                )
                break


def _one_edit(a: str, b: str) -> bool:
    """Whether ``a`` becomes ``b`` by one insertion, deletion, substitution or swap of two
    neighbouring characters."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        if len(diff) == 1:
            return True
        i, j = diff[0], diff[-1]
        return len(diff) == 2 and j == i + 1 and a[i] == b[j] and a[j] == b[i]
    short, long = (a, b) if len(a) < len(b) else (b, a)
    return any(long[:i] + long[i + 1 :] == short for i in range(len(long)))
