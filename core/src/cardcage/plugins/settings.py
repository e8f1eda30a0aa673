"""What to say about the plugin settings: the variables, unknown names, no backend loaded.

The settings are the four ``CARDCAGE_*PLUGINS*`` variables (parsed by
:mod:`cardcage.config.variables`) that decide which plugins :mod:`cardcage.plugins.manager`
loads. Here: which they are, the install hint of each shipped backend, and the explanations:
a name in ``CARDCAGE_PLUGINS`` or ``CARDCAGE_DISABLE_PLUGINS`` that no installed plugin has, a
registry with no backend, a shipped backend whose plugin is installed but not loaded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from cardcage.config.flags import did_you_mean
from cardcage.config.variables import DISABLE_PLUGINS, PLUGINS, PLUGINS_AUTOLOAD, STRICT_PLUGINS

#: The plugin settings: a registry is loaded once for each distinct value of them.
SETTINGS = (DISABLE_PLUGINS, PLUGINS_AUTOLOAD, PLUGINS, STRICT_PLUGINS)

#: The backends that ship with cardcage, for install hints only (never imported by name).
KNOWN_BACKENDS: dict[str, str] = {
    "cpu": "cardcage-cpu",
    "gpu": "cardcage-gpu",
    "dp": "cardcage-dp",
    "ddp": "cardcage-ddp",
    "ddp2": "cardcage-ddp2",
    "ddp_spawn": "cardcage-spawn",
    "spawn": "cardcage-spawn",
    "ddp_cpu": "cardcage-spawn",
    "horovod": "cardcage-horovod",
    "tpu": "cardcage-tpu",
    "fsdp": "cardcage-fsdp",
    "fsdp_spawn": "cardcage-fsdp",
}


def install_command(name: str) -> str:
    """The pip command that installs the plugin providing backend ``name``."""
    return f"pip install {KNOWN_BACKENDS.get(name, f'cardcage-{name}')}"


class _Record(Protocol):
    """What the explanations read of a :class:`cardcage.plugins.manager.PluginRecord`."""

    @property
    def name(self) -> str: ...
    @property
    def distribution(self) -> str | None: ...
    @property
    def status(self) -> str: ...
    @property
    def error(self) -> str | None: ...


class _Registry(Protocol):
    """What the explanations read of a :class:`cardcage.plugins.manager.Registry` (this module is
    below :mod:`cardcage.plugins.manager`, which imports it)."""

    @property
    def accelerators(self) -> Mapping[str, object]: ...
    @property
    def plugins(self) -> Sequence[_Record]: ...
    @property
    def settings(self) -> Mapping[str, str | None]: ...


def unknown_plugin(variable: str, name: str, known: Mapping[str, str | None]) -> str:
    """What to say about ``name`` in ``variable`` when no plugin of that name is installed:
    the likely meant name, and the installed ones. ``known``: plugin name -> distribution."""
    hint = did_you_mean(name, sorted(known))
    distribution = KNOWN_BACKENDS.get(name.lower())
    owner = [plugin for plugin, dist in known.items() if dist and dist == distribution]
    if owner and owner[0] != name:
        # a backend name where a plugin (entry-point) name belongs: ddp_spawn for spawn
        hint = f" {name!r} is a backend of the plugin {owner[0]!r}: use {owner[0]!r}."
    installed = ", ".join(sorted(known)) or "none"
    return (
        f"{variable} names {name!r}, but no installed distribution has a 'cardcage' entry "
        f"point of that name, so it has no effect.{hint} Plugins are named by entry point; "
        f"installed: {installed}."
    )


def no_backend_loaded(registry: _Registry) -> str | None:
    """Why ``registry`` holds no backend, in words (``None`` when it holds one): the plugin
    settings that left every backend out, or that none is installed, and what to set."""
    if registry.accelerators:
        return None
    settings = registry.settings
    records = registry.plugins
    by_status: dict[str, list[str]] = {}
    for record in records:
        by_status.setdefault(record.status, []).append(record.name)
    reasons = []
    left_out = by_status.get("not autoloaded", [])
    if left_out:
        named = settings.get(PLUGINS)
        reasons.append(
            f"{PLUGINS_AUTOLOAD}={settings.get(PLUGINS_AUTOLOAD)!r} loads only the plugins "
            f"{PLUGINS} names, and "
            + (
                f"{PLUGINS}={named!r} names no installed backend"
                if named
                else f"{PLUGINS} is unset"
            )
        )
    if by_status.get("disabled"):
        reasons.append(
            f"{DISABLE_PLUGINS}={settings.get(DISABLE_PLUGINS)!r} disables "
            + ", ".join(repr(n) for n in by_status["disabled"])
        )
    failed = [r for r in records if r.status == "failed" and r.distribution]
    if failed:
        reasons.append(
            "plugins failed to load: " + "; ".join(f"{r.name}: {r.error}" for r in failed)
        )
    if not reasons:
        return (
            "no backend is loaded: no installed distribution provides a cardcage backend. "
            f"Install one, e.g. `{install_command('cpu')}` (or `pip install cardcage` for all)."
        )
    fix = (
        f"Unset {PLUGINS_AUTOLOAD}, or set {PLUGINS} to the plugins to load (installed: "
        + (", ".join(sorted(left_out)))
        + ")"
        if left_out
        else f"Take the backends you need out of {DISABLE_PLUGINS} (or unset it)"
        if by_status.get("disabled")
        else "Fix or reinstall the plugins that failed (`cardcage plugins` shows why)"
    )
    return f"no backend is loaded: {'; '.join(reasons)}. {fix}."


def why_not_loaded(registry: _Registry, backend: str) -> str | None:
    """Why the shipped backend ``backend`` is not in ``registry`` although its plugin is
    installed (disabled, not autoloaded, failed), with what to set; ``None`` when its plugin
    is not installed."""
    distribution = KNOWN_BACKENDS.get(backend)
    record = next(
        (r for r in registry.plugins if distribution and r.distribution == distribution), None
    )
    if record is None:
        return None
    settings = registry.settings
    plugin = record.name
    if record.status == "disabled":
        return (
            f"its plugin {plugin!r} ({distribution}) is installed but disabled by "
            f"{DISABLE_PLUGINS}={settings.get(DISABLE_PLUGINS)!r}. Take {plugin!r} out of "
            f"{DISABLE_PLUGINS} (or unset it)"
        )
    if record.status == "not autoloaded":
        named = settings.get(PLUGINS)
        wanted = ",".join([*(n.strip() for n in (named or "").split(",") if n.strip()), plugin])
        return (
            f"its plugin {plugin!r} ({distribution}) is installed but not loaded: "
            f"{PLUGINS_AUTOLOAD}={settings.get(PLUGINS_AUTOLOAD)!r} loads only the plugins "
            f"{PLUGINS} names"
            + (f" ({PLUGINS}={named!r})" if named else f", and {PLUGINS} is unset")
            + f". Set {PLUGINS}={wanted}, or unset {PLUGINS_AUTOLOAD}"
        )
    if record.status == "failed":
        return (
            f"its plugin {plugin!r} ({distribution}) failed to load: {record.error}. Reinstall "
            f"it (`{install_command(backend)}`), or pick another backend"
        )
    return None
