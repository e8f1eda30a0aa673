"""cardcage: train PyTorch models on whichever accelerator fits the job.

The core (the cage) holds the Accelerator protocol, the plugin manager and the rule-ordered
selection engine; every backend is a plugin found through the entry-point group
``cardcage``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cardcage._version import __version__
from cardcage.accelerator import Accelerator, Availability, Resolution, Rule
from cardcage.errors import MisconfigurationError, PluginError
from cardcage.selection import Selection, SelectionContext, select
from cardcage.spec import hookimpl
from cardcage.trainer import Trainer

if TYPE_CHECKING:
    from cardcage.submit import SlurmJob

__all__ = [
    "Accelerator",
    "Availability",
    "MisconfigurationError",
    "PluginError",
    "Resolution",
    "Rule",
    "Selection",
    "SelectionContext",
    "SlurmJob",
    "Trainer",
    "__version__",
    "hookimpl",
    "select",
]


def __getattr__(name: str) -> Any:
    # cardcage.SlurmJob loads the submission package (and its CLI) on first use only: most
    # programs that import cardcage never submit a job.
    if name == "SlurmJob":
        from cardcage.submit import SlurmJob

        return SlurmJob
    raise AttributeError(f"module 'cardcage' has no attribute {name!r}")
