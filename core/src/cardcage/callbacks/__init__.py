"""Callbacks: code the training loop calls at Lightning 1.0's hook points.

``Callback`` is the base class (``cardcage.Callback``); ``ModelCheckpoint`` and
``EarlyStopping`` ship with the core. The loop (``cardcage.train``) calls the hooks in
:data:`~cardcage.callbacks.base.CALLBACK_HOOKS` that a callback overrides
(:func:`~cardcage.callbacks.base.overridden`). This package imports nothing of
``cardcage.train``: it sees the trainer through the attributes that docs/training-loop.md
("Callbacks") lists.
"""

from __future__ import annotations

from cardcage.callbacks.base import (
    CALLBACK_HOOKS,
    INIT_HOOKS,
    NOT_CALLED,
    STATE_HOOKS,
    Callback,
    ignored_hooks,
    overridden,
)
from cardcage.callbacks.early_stopping import EarlyStopping
from cardcage.callbacks.model_checkpoint import ModelCheckpoint

__all__ = [
    "CALLBACK_HOOKS",
    "INIT_HOOKS",
    "NOT_CALLED",
    "STATE_HOOKS",
    "Callback",
    "EarlyStopping",
    "ModelCheckpoint",
    "ignored_hooks",
    "overridden",
]
