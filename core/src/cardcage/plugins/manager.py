"""Finding, loading and registering plugins (pytest's behaviour at tox's size).

Plugins are the modules named by entry points of the group ``cardcage``; the nine backends
that ship with cardcage are found the same way. Loading follows four environment variables:

- ``CARDCAGE_DISABLE_PLUGINS=a,b``: never load these (entry-point names).
- ``CARDCAGE_PLUGINS_AUTOLOAD=0``: load no entry point except those in ``CARDCAGE_PLUGINS``.
- ``CARDCAGE_PLUGINS=a,b``: load these even with autoload off.
- ``CARDCAGE_STRICT_PLUGINS=1``: a plugin that fails to import or register is an error
  instead of being skipped and listed.

A name in ``CARDCAGE_PLUGINS`` or ``CARDCAGE_DISABLE_PLUGINS`` that no installed
distribution provides warns (with a did-you-mean) and is listed by ``cardcage plugins``. The
variables are parsed by :mod:`cardcage.config.variables`; what to say about them (unknown names, no
backend loaded, a shipped backend not loaded, install hints) is in
:mod:`cardcage.plugins.settings`.

Nothing here imports a backend's engine (horovod, torch_xla); only the plugin modules.
A plugin's check that takes long (a backend's ``availability``) is named on stderr while it
runs (:func:`named_while_slow`): by ``cardcage plugins``, and, inside
:func:`slow_checks_named`, by the Trainer's and ``cardcage explain``'s selection.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import importlib.metadata as metadata
import inspect
import sys
import threading
import time
import traceback
import types
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

import pluggy

from cardcage.backend.accelerator import Accelerator, Rule
from cardcage.config.variables import (
    DISABLE_PLUGINS,
    PLUGINS,
    plugin_names,
    plugins_autoload,
    strict_plugins,
)
from cardcage.environments.base import ClusterEnvironment
from cardcage.environments.builtin import BUILTIN_ENVIRONMENTS
from cardcage.errors import PluginError
from cardcage.loggers import BUILTIN_LOGGERS
from cardcage.loggers.base import Logger
from cardcage.plugins import spec
from cardcage.plugins.settings import (
    SETTINGS,
    unknown_plugin,
)

GROUP = "cardcage"
#: A plugin's check still running after this many seconds is named on stderr, and again
#: every as many seconds until it returns.
SLOW_CHECK_S = 5.0


@dataclass(frozen=True)
class PluginRecord:
    """One entry point of the ``cardcage`` group and what became of it."""

    name: str
    module: str
    distribution: str | None
    version: str | None
    status: str  # loaded | failed | disabled | not autoloaded | not installed
    error: str | None = None
    accelerators: tuple[str, ...] = ()
    loggers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Registered:
    """A registered backend class and the plugin it came from."""

    cls: type[Accelerator]
    plugin: str
    distribution: str | None
    version: str | None


#: Who registered the built-in loggers, as a logger name's owner is named in a conflict.
BUILTIN_OWNER = "cardcage-core (built in)"


def _builtin_loggers() -> dict[str, type[Logger]]:
    return {cls.logger_name: cls for cls in BUILTIN_LOGGERS}


def _builtin_logger_owners() -> dict[str, str]:
    return dict.fromkeys(_builtin_loggers(), BUILTIN_OWNER)


@dataclass
class Registry:
    """Everything the loaded plugins registered."""

    accelerators: dict[str, Registered] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    environments: tuple[type[ClusterEnvironment], ...] = BUILTIN_ENVIRONMENTS
    #: Logger classes by lower-case ``logger_name`` (``Trainer(logger="name")``): the
    #: built-in ones and those of the ``cardcage_loggers`` hook.
    loggers: dict[str, type[Logger]] = field(default_factory=_builtin_loggers)
    #: Who registered each logger name: the plugin and its distribution.
    logger_owners: dict[str, str] = field(default_factory=_builtin_logger_owners)
    plugins: list[PluginRecord] = field(default_factory=list)
    hooks: Any = None  # the pluggy hook relay, for lifecycle and report hooks
    #: The plugin settings (:data:`SETTINGS`) this registry was loaded with.
    settings: dict[str, str | None] = field(default_factory=dict)

    def canonical(self, name: str) -> str | None:
        """The canonical backend name for a name or alias, or ``None`` if unknown."""
        key = name.strip().lower()
        if key in self.accelerators:
            return key
        return self.aliases.get(key)

    def names(self) -> list[str]:
        """Every name and alias that selects an installed backend, sorted."""
        return sorted([*self.accelerators, *self.aliases])

    def ordered_rules(self) -> list[tuple[Rule, Registered]]:
        """All rules of all backends, ascending by order, ties by backend name."""
        pairs = [(rule, reg) for reg in self.accelerators.values() for rule in reg.cls.rules]
        return sorted(pairs, key=lambda pair: (pair[0].order, pair[1].cls.name))


def _failure(error: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(error), error)).strip()


def _identity(dist: metadata.Distribution | None) -> tuple[str | None, str | None]:
    """A distribution's ``Name`` and ``Version``, read from its metadata headers once.

    ``dist.metadata`` (behind ``dist.version`` too) runs the email parser over the whole
    file, long description included, on every access; discovery needs two header fields
    per plugin. Falls back to ``dist.metadata`` when the headers do not hold both.
    """
    if dist is None:
        return None, None
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    found: dict[str, str] = {}
    for line in text.partition("\n\n")[0].splitlines():
        key, colon, value = line.partition(":")
        if colon and key in ("Name", "Version") and key not in found:
            found[key] = value.strip()
    if "Name" in found and "Version" in found:
        return found["Name"], found["Version"]
    meta = dist.metadata
    return meta["Name"], meta["Version"]


_HOOKABLE = (types.FunctionType, types.MethodType, staticmethod, classmethod)
_MISSING = object()


class _HookManager(pluggy.PluginManager):
    """pluggy's manager with a fast path for module plugins (every entry-point plugin).

    pluggy looks at each name in ``dir(plugin)`` through ``inspect.getattr_static``, which
    costs about half a millisecond per plugin module; a module attribute that is not a
    function or method is skipped here without that, and the rest are left to pluggy.
    """

    def parse_hookimpl_opts(self, plugin: object, name: str) -> pluggy.HookimplOpts | None:
        if isinstance(plugin, types.ModuleType):
            value = vars(plugin).get(name, _MISSING)
            if value is not _MISSING and not isinstance(value, _HOOKABLE):
                return None
        return super().parse_hookimpl_opts(plugin, name)


class PluginManager:
    """Loads entry-point plugins into a pluggy manager and builds the :class:`Registry`."""

    def __init__(self, env: Mapping[str, str], extra: Mapping[str, object] | None = None):
        self.env = env
        self.extra = dict(extra or {})
        self.pm = _HookManager(spec.NAME)
        self.pm.add_hookspecs(spec)
        from cardcage.plugins import core_hooks

        self.pm.register(core_hooks, name="cardcage.plugins.core_hooks")
        self.strict = strict_plugins(env)
        self.records: list[PluginRecord] = []

    def _record(self, record: PluginRecord, error: BaseException | None = None) -> None:
        if record.status == "failed" and self.strict:
            raise PluginError(
                f"cardcage plugin {record.name!r} ({record.distribution or 'unknown'}) failed: "
                f"{record.error}. Unset CARDCAGE_STRICT_PLUGINS to skip broken plugins."
            ) from error
        self.records.append(record)

    def load(self) -> Registry:
        with _collector_paused():
            return self._load()

    def _load(self) -> Registry:
        disabled = plugin_names(self.env, DISABLE_PLUGINS)
        autoload = plugins_autoload(self.env)
        wanted = plugin_names(self.env, PLUGINS)
        distributions: dict[str, str | None] = {}  # every entry point's name -> distribution
        sources: dict[str, tuple[str | None, str | None]] = {}
        for ep in sorted(metadata.entry_points(group=GROUP), key=lambda e: e.name):
            dist = getattr(ep, "dist", None)
            dist_name, version = _identity(dist)
            base = PluginRecord(ep.name, ep.value, dist_name, version, status="found")
            distributions.setdefault(ep.name, dist_name)
            if ep.name in disabled:
                self._record(replace(base, status="disabled"))
                continue
            if not autoload and ep.name not in wanted:
                self._record(replace(base, status="not autoloaded"))
                continue
            if ep.name in sources:
                other = sources[ep.name][0]
                raise PluginError(
                    f"two distributions register the cardcage plugin {ep.name!r}: {other} and "
                    f"{dist_name}. Uninstall one of them, or disable it with "
                    f"CARDCAGE_DISABLE_PLUGINS={ep.name}."
                )
            try:
                plugin = ep.load()
                self.pm.register(plugin, name=ep.name)
            except Exception as error:
                self._record(replace(base, status="failed", error=_failure(error)), error)
                continue
            sources[ep.name] = (dist_name, version)
        for name, plugin in self.extra.items():
            if name not in disabled:
                try:
                    self.pm.register(plugin, name=name)
                except ValueError as error:  # pluggy: name taken, or plugin already loaded
                    first_line = str(error).splitlines()[0]
                    raise PluginError(
                        f"in-process plugin {name!r} cannot be registered: {first_line}. An "
                        "installed plugin already uses that name or that module; pick another "
                        "name in cardcage.plugins.manager.register(), or disable the installed "
                        f"one with CARDCAGE_DISABLE_PLUGINS={name}."
                    ) from None
                sources[name] = (None, None)
        known = {**distributions, **dict.fromkeys(self.extra)}
        for variable, names, status in (
            (PLUGINS, wanted, "failed"),
            (DISABLE_PLUGINS, disabled, "not installed"),
        ):
            for name in sorted(names - set(known)):
                said = unknown_plugin(variable, name, known)
                warnings.warn(f"cardcage: {said}", UserWarning, stacklevel=1)
                self._record(PluginRecord(name, "", None, None, status, error=said))
        registry = self._build(sources)
        registry.settings = {name: self.env.get(name) for name in SETTINGS}
        return registry

    def _build(self, sources: dict[str, tuple[str | None, str | None]]) -> Registry:
        registry = Registry(hooks=self.pm.hook, plugins=self.records)
        environments = list(BUILTIN_ENVIRONMENTS)
        for name, (dist, version) in sources.items():
            plugin = self.pm.get_plugin(name)
            module = str(getattr(plugin, "__name__", repr(plugin)))
            base = PluginRecord(name, module, dist, version, status="found")
            try:
                classes = self._call(plugin, "cardcage_accelerators", Accelerator)
                envs = self._call(plugin, "cardcage_cluster_environments", ClusterEnvironment)
                loggers = self._logger_classes(plugin)
            except Exception as error:
                self.pm.unregister(plugin)
                self._record(replace(base, status="failed", error=_failure(error)), error)
                continue
            for cls in classes:
                self._add(registry, Registered(cls, name, dist, version))
            environments.extend(envs)
            owner = f"{name} ({dist or 'registered in-process'})"
            for logger in loggers:
                self._add_logger(registry, logger, owner)
            accelerators = tuple(c.name for c in classes)
            logger_names = tuple(c.logger_name.strip().lower() for c in loggers)
            self.records.append(
                replace(base, status="loaded", accelerators=accelerators, loggers=logger_names)
            )
        registry.environments = tuple(environments)
        registry.plugins.sort(key=lambda r: r.name)
        return registry

    @staticmethod
    def _call(plugin: object, hook: str, base: type) -> list[Any]:
        function = getattr(plugin, hook, None)
        if function is None:
            return []
        result = function()
        items = list(result or [])
        for item in items:
            if not (isinstance(item, type) and issubclass(item, base)):
                raise TypeError(f"{hook}() returned {item!r}, not a {base.__name__} subclass")
            if not isinstance(getattr(item, "name", None), str) or not item.name:  # type: ignore[attr-defined]
                raise TypeError(f"{hook}() returned {item.__name__} without a name")
        if base is Accelerator:
            for item in items:
                for rule in item.rules:
                    if (
                        not isinstance(rule, Rule)
                        or isinstance(rule.order, bool)
                        or not isinstance(rule.order, int)
                    ):
                        raise TypeError(
                            f"{item.__name__}.rules holds {rule!r}, not a Rule(order=int)"
                        )
        return items

    @staticmethod
    def _logger_classes(plugin: object) -> list[type[Logger]]:
        """What the plugin's ``cardcage_loggers`` returned, checked: concrete
        :class:`~cardcage.loggers.Logger` subclasses with a ``logger_name``, each buildable as
        ``cls(save_dir=...)``."""
        function = getattr(plugin, "cardcage_loggers", None)
        if function is None:
            return []
        items = list(function() or [])
        for item in items:
            if not (isinstance(item, type) and issubclass(item, Logger)):
                raise TypeError(
                    f"cardcage_loggers() returned {item!r}, not a cardcage.sdk.Logger subclass"
                )
            name = getattr(item, "logger_name", None)
            if not isinstance(name, str) or not name.strip():
                raise TypeError(
                    f"cardcage_loggers() returned {item.__name__} without a logger_name"
                )
            if inspect.isabstract(item):
                missing = ", ".join(sorted(getattr(item, "__abstractmethods__", ())))
                raise TypeError(
                    f"cardcage_loggers() returned {item.__name__}, which does not implement "
                    f"{missing}"
                )
            try:
                inspect.signature(item).bind(save_dir="logs")
            except TypeError as error:
                raise TypeError(
                    f"cardcage_loggers() returned {item.__name__}, which cannot be built as "
                    f"{item.__name__}(save_dir=...) ({error}): every other argument of its "
                    "constructor needs a default"
                ) from None
        return items

    @staticmethod
    def _add_logger(registry: Registry, cls: type[Logger], owner: str) -> None:
        key = cls.logger_name.strip().lower()
        if key in registry.loggers:
            raise PluginError(
                f"logger name {key!r} is claimed twice: {registry.logger_owners[key]} and "
                f"{owner}. Uninstall one, or disable it with CARDCAGE_DISABLE_PLUGINS=<name>."
            )
        registry.loggers[key] = cls
        registry.logger_owners[key] = owner

    @staticmethod
    def _add(registry: Registry, entry: Registered) -> None:
        def owner(name: str) -> Registered:
            return registry.accelerators[registry.canonical(name) or name]

        for label in (n.lower() for n in entry.cls.names()):
            if registry.canonical(label) is not None:
                other = owner(label)
                raise PluginError(
                    f"backend name {label!r} is claimed by two plugins: {other.plugin} "
                    f"({other.distribution or 'registered in-process'}) and {entry.plugin} "
                    f"({entry.distribution or 'registered in-process'}). Uninstall one, or "
                    f"disable it with CARDCAGE_DISABLE_PLUGINS=<name>."
                )
        registry.accelerators[entry.cls.name.lower()] = entry
        for alias in entry.cls.aliases:
            registry.aliases[alias.lower()] = entry.cls.name.lower()


@dataclass
class Timed:
    """What :func:`named_while_slow` measured: the seconds the block took (once it left)."""

    seconds: float = 0.0
    named: bool = False  # whether it ran long enough to be named on stderr


@contextlib.contextmanager
def named_while_slow(
    what: str, after: float | None = None, stream: TextIO | None = None
) -> Iterator[Timed]:
    """Time the block; while it runs longer than ``after`` seconds (:data:`SLOW_CHECK_S`),
    name ``what`` on ``stream`` (stderr) every ``after`` seconds, and say when it returns.

    For a plugin's code that cardcage waits for (a backend's ``availability``, which may
    probe a device or a network): a check that hangs is named while it hangs, instead of
    the command being silent. A thread waits beside the block; the block itself runs as
    before, in this thread.
    """
    every = SLOW_CHECK_S if after is None else after
    timed = Timed()
    done = threading.Event()
    begin = time.monotonic()

    def say(line: str) -> None:
        out = sys.stderr if stream is None else stream
        with contextlib.suppress(OSError, ValueError):  # a closed stream: stay quiet
            out.write(f"cardcage: {line}\n")
            out.flush()

    def watch() -> None:
        while not done.wait(every):
            timed.named = True
            say(f"waiting for {what} ({time.monotonic() - begin:.0f} s so far)")

    watcher = threading.Thread(target=watch, name="cardcage-slow-check", daemon=True)
    watcher.start()
    try:
        yield timed
    finally:
        done.set()
        watcher.join()
        timed.seconds = time.monotonic() - begin
        if timed.named:
            say(f"{what} returned after {timed.seconds:.1f} s")


def check_label(plugin: str | None, backend: str) -> str:
    """How a backend's availability check is named on stderr."""
    owner = f"plugin {plugin}'s" if plugin else "the"
    return f"{owner} availability check of backend {backend!r}"


#: Whether availability checks name themselves while slow (:func:`slow_checks_named`).
_checks_named: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "cardcage_checks_named", default=False
)


@contextlib.contextmanager
def slow_checks_named() -> Iterator[None]:
    """Inside the block, each availability check that selection runs in this context is
    watched by :func:`named_while_slow`. For the callers that may start a thread (the
    Trainer's constructor, ``cardcage explain``); ``select`` alone starts none."""
    token = _checks_named.set(True)
    try:
        yield
    finally:
        _checks_named.reset(token)


def watched_check(plugin: str | None, backend: str) -> contextlib.AbstractContextManager[Any]:
    """Around one availability check: named while slow inside :func:`slow_checks_named`,
    else nothing (no thread)."""
    if not _checks_named.get():
        return contextlib.nullcontext()
    return named_while_slow(check_label(plugin, backend))


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Automatic garbage collection off while plugins load, as it was afterwards.

    Loading plugins allocates long-lived objects (modules, classes, functions) and next to no
    garbage. With hundreds of plugins those allocations cross the threshold of a full
    collection, which walks the whole heap ``import torch`` left behind: measured here, about
    100 ms of the 215 ms that 200 plugins cost. Paused, the objects count once towards the
    collector's schedule when it resumes, like any other allocation of the program.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


_cache: dict[tuple[object, ...], Registry] = {}
_extra: dict[str, object] = {}


def registry(env: Mapping[str, str]) -> Registry:
    """The registry for the plugin settings in ``env``; loaded once per distinct setting."""
    key = (tuple(env.get(name) for name in SETTINGS), tuple(_extra))
    if key not in _cache:
        _cache[key] = PluginManager(env, _extra).load()
    return _cache[key]


def register(plugin: object, name: str | None = None) -> None:
    """Register an in-process plugin (a module or object with hook functions).

    For scripts and tests that define a backend without packaging it; a packaged plugin
    uses the entry point instead.
    """
    _extra[name or str(getattr(plugin, "__name__", repr(plugin)))] = plugin
    _cache.clear()


def unregister(name: str) -> None:
    """Remove an in-process plugin added by :func:`register`."""
    _extra.pop(name, None)
    _cache.clear()


def clear_cache() -> None:
    """Forget loaded registries, e.g. after installing a plugin in this process."""
    _cache.clear()
