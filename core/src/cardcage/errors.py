"""The errors cardcage raises on purpose."""

from __future__ import annotations


class MisconfigurationError(ValueError):
    """An invalid flag, environment variable or combination of them.

    Raised before any process, port or CUDA context exists. The message names the flag (or
    variable), the value it had, and what to set instead.
    """


class PluginError(RuntimeError):
    """A backend plugin could not be loaded or registered, or two plugins claim one name.

    Raised only for conflicts, and for load failures when ``CARDCAGE_STRICT_PLUGINS=1``;
    otherwise a broken plugin is skipped and listed by ``cardcage plugins``.
    """
