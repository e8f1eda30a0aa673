"""cardcage: train PyTorch models on whichever accelerator fits the job.

The core (the cage) holds the Accelerator protocol, the plugin manager and the rule-ordered
selection engine; every backend is a plugin found through the entry-point group
``cardcage``.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from cardcage import callbacks, loggers
from cardcage._version import __version__
from cardcage.backend.accelerator import Accelerator, Availability, Resolution, Rule
from cardcage.backend.selection_types import Selection, SelectionContext
from cardcage.callbacks import Callback
from cardcage.errors import (
    CheckpointError,
    MisconfigurationError,
    NonFiniteLossError,
    PluginError,
    RankFailedError,
)
from cardcage.plugins.spec import hookimpl
from cardcage.selection.engine import select
from cardcage.train.cage import Cage
from cardcage.train.module import Module
from cardcage.train.seeding import seed_everything
from cardcage.train.trainer import Trainer

if TYPE_CHECKING:
    from cardcage_submit import SlurmJob as SlurmJob

# cardcage.SlurmJob is not listed: it exists only with the extension cardcage-submit, and
# `from cardcage import *` must work without it.
__all__ = [
    "Accelerator",
    "Availability",
    "Cage",
    "Callback",
    "CheckpointError",
    "MisconfigurationError",
    "Module",
    "NonFiniteLossError",
    "PluginError",
    "RankFailedError",
    "Resolution",
    "Rule",
    "Selection",
    "SelectionContext",
    "Trainer",
    "__version__",
    "callbacks",
    "hookimpl",
    "loggers",
    "seed_everything",
    "select",
]


def __getattr__(name: str) -> Any:
    # cardcage.SlurmJob comes from the extension cardcage-submit (`pip install
    # 'cardcage[submit]'`), loaded on first use only: most programs that import cardcage never
    # submit a job.
    if name == "SlurmJob":
        try:
            from cardcage_submit import SlurmJob
        except ModuleNotFoundError as error:
            if error.name != "cardcage_submit":
                raise  # cardcage-submit is there but broken: its own error says more
            raise AttributeError(
                "cardcage.SlurmJob needs cardcage-submit, which is not installed: "
                "pip install 'cardcage[submit]'",
                name=name,
                obj=sys.modules[__name__],
            ) from None
        return SlurmJob
    raise AttributeError(f"module 'cardcage' has no attribute {name!r}")
