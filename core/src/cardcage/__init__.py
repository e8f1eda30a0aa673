"""cardcage: train PyTorch models on whichever accelerator fits the job.

The core (the cage) holds the Accelerator protocol, the plugin manager and the rule-ordered
selection engine; every backend is a plugin found through the entry-point group
``cardcage``.
"""

from __future__ import annotations

from cardcage._version import __version__
from cardcage.accelerator import Accelerator, Availability, Resolution, Rule
from cardcage.errors import MisconfigurationError, PluginError
from cardcage.selection import Selection, SelectionContext, select
from cardcage.spec import hookimpl
from cardcage.submit import SlurmJob
from cardcage.trainer import Trainer

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
