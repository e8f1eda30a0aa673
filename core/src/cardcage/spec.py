"""The hooks a cardcage plugin may implement.

Implement a hook with a module-level function of the same name decorated with
:data:`cardcage.hookimpl`, and point the ``cardcage`` entry-point group at the module::

    [project.entry-points.cardcage]
    foo = "cardcage_foo"

Every hook here is typed and documented; a test fails when one is not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from cardcage.accelerator import Accelerator
    from cardcage.environments import ClusterEnvironment

NAME = "cardcage"
_spec = pluggy.HookspecMarker(NAME)
hookimpl = pluggy.HookimplMarker(NAME)


@_spec
def cardcage_accelerators() -> list[type[Accelerator]]:
    """Register backends.

    Called once per plugin when plugins are loaded. Each returned class becomes selectable by
    its ``name`` and ``aliases`` and takes part in automatic selection through its ``rules``.
    Two plugins claiming one name or alias is an error naming both distributions.

    :return: the :class:`~cardcage.Accelerator` subclasses this plugin provides.
    """
    raise AssertionError("hookspec")  # pragma: no cover


@_spec
def cardcage_cluster_environments() -> list[type[ClusterEnvironment]]:
    """Register cluster environments (schedulers or launchers that create processes).

    Environments are detected in ascending ``order`` before the built-in fallback to the
    local machine; the built-in ones are horovodrun/mpirun (100), torchelastic (200) and
    SLURM (300), so pick an order that places yours where it belongs.

    :return: the :class:`~cardcage.environments.ClusterEnvironment` subclasses this plugin
        provides.
    """
    raise AssertionError("hookspec")  # pragma: no cover


@_spec
def cardcage_env_report() -> dict[str, str]:
    """Add lines to ``cardcage env``, the text a bug report needs.

    Called only by ``cardcage env``; it may import heavy modules.

    :return: a mapping of label to value, shown under the plugin's name.
    """
    raise AssertionError("hookspec")  # pragma: no cover
