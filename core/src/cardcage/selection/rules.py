"""Evaluating the backends for a job: what a rule sees, and the trace of what each rule did.

Used by :func:`cardcage.select`, which gathers the flags, GPUs and cluster environment into a
:class:`SelectionContext` and then either resolves the named ``distributed_backend``
(:func:`resolve_named`) or evaluates every rule in ascending order (:func:`run_rules`).
Their types (:class:`~cardcage.backend.selection_types.SelectionContext`, ``TraceEntry``) are
in :mod:`cardcage.backend.selection_types`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from cardcage.backend.accelerator import Accelerator, Availability
from cardcage.backend.selection_types import SelectionContext, TraceEntry
from cardcage.config.flags import did_you_mean
from cardcage.errors import MisconfigurationError
from cardcage.plugins import manager as plugins
from cardcage.plugins import settings

MAX_REDIRECTS = 4


def check_availability(
    cls: type[Accelerator], ctx: SelectionContext, plugin: str | None = None
) -> Availability:
    """``cls.availability(ctx)``; a check that raises (but for a misconfiguration) is
    reported as unavailable with the error, so that one broken plugin cannot stop selection.
    Inside :func:`plugins.slow_checks_named`, a slow check is named (as ``plugin``'s)."""
    try:
        with plugins.watched_check(plugin, cls.name):
            return cls.availability(ctx)
    except MisconfigurationError:
        raise
    except Exception as error:  # a broken check must not take selection down
        return Availability(False, f"availability check raised {type(error).__name__}: {error}")


def _unknown_backend(name: str, registry: plugins.Registry) -> MisconfigurationError:
    empty = settings.no_backend_loaded(registry)
    if name in settings.KNOWN_BACKENDS:
        why = settings.why_not_loaded(registry, name)
        if why is not None:
            return MisconfigurationError(f"distributed_backend={name!r} is not loaded: {why}.")
        return MisconfigurationError(
            f"distributed_backend={name!r} is a cardcage backend whose plugin is not "
            f"installed. Install it with `{settings.install_command(name)}`, or "
            + (f"load a backend ({empty})" if empty else "pick an installed backend: ")
            + ("" if empty else ", ".join(registry.names()) + ".")
        )
    if empty:
        return MisconfigurationError(f"distributed_backend={name!r} cannot be selected: {empty}")
    return MisconfigurationError(
        f"distributed_backend={name!r} is not an installed backend."
        f"{did_you_mean(name, registry.names())} Installed: {', '.join(registry.names())}."
    )


def lookup_backend(registry: plugins.Registry, name: str) -> type[Accelerator]:
    """The installed backend ``name`` (or an alias) names; an error that says what to do."""
    canonical = registry.canonical(name)
    if canonical is None:
        raise _unknown_backend(name, registry)
    return registry.accelerators[canonical].cls


def rule_name(rule: Any, cls: type[Accelerator]) -> str:
    """A rule's name, ``<backend>.<order>`` when it has none."""
    return str(rule.name or f"{cls.name}.{rule.order}")


def not_evaluated(registry: plugins.Registry) -> tuple[TraceEntry, ...]:
    """The trace of a job that named its backend: every rule, none of them evaluated."""
    return tuple(
        TraceEntry(rule.order, rule_name(rule, reg.cls), reg.cls.name, rule.why, "not evaluated")
        for rule, reg in registry.ordered_rules()
    )


def resolve_named(
    cls: type[Accelerator],
    ctx: SelectionContext,
    registry: plugins.Registry,
    warnings: list[str],
) -> tuple[type[Accelerator], SelectionContext, str, str]:
    """Follow a named backend's ``resolve`` hand-offs; check the last one is available.

    Returns the backend that runs, the context it runs with, the rule name and why.
    """
    seen = [cls.name]
    named = ctx.requested_as or cls.name
    current = cls
    while True:
        resolution = current.resolve(ctx)
        if resolution.warning:
            warnings.append(resolution.warning)
        if resolution.drop_gpus:
            ctx = replace(ctx, gpu_ids=None, num_gpus=0)
        if resolution.accelerator == current.name:
            break
        if resolution.accelerator in seen or len(seen) > MAX_REDIRECTS:
            raise MisconfigurationError(
                f"distributed_backend={named!r}: backends hand the job to each "
                f"other in a loop ({' -> '.join([*seen, resolution.accelerator])}). Report "
                "this to the plugins' authors."
            )
        seen.append(resolution.accelerator)
        if registry.canonical(resolution.accelerator) is None:
            reason = f" ({resolution.warning})" if resolution.warning else ""
            raise MisconfigurationError(
                f"distributed_backend={named!r} hands the job to the "
                f"{resolution.accelerator!r} backend here{reason}, but that backend's plugin "
                f"is not installed (or was disabled). Install it with "
                f"`{settings.install_command(resolution.accelerator)}`, or change the flags."
            )
        current = lookup_backend(registry, resolution.accelerator)
        # Only the named backend's own checks apply on the first hop; the next one resolves
        # as if it had been named itself.
        ctx = replace(ctx, requested=current.name, requested_as=current.name)
    entry = registry.accelerators.get(current.name.lower())
    availability = check_availability(current, ctx, entry.plugin if entry else None)
    if not availability:
        # a hint may start with a command (``pip install ...``): joined, not capitalised
        hint = f"; {availability.hint.strip().rstrip('.')}" if availability.hint else ""
        raise MisconfigurationError(
            f"distributed_backend={named!r} selects {current.name!r}, which is "
            f"not available here: {availability.reason}{hint}."
        )
    ctx = replace(ctx, requested=cls.name, requested_as=ctx.requested_as)
    why = f"distributed_backend={named!r} was named"
    if named.lower() != cls.name:
        why += f" (an alias of {cls.name!r})"
    if len(seen) > 1:
        why += f" and runs as {current.name!r}"
    return current, ctx, "distributed_backend", why


def run_rules(
    ctx: SelectionContext, registry: plugins.Registry, warnings: list[str]
) -> tuple[type[Accelerator], str, str, tuple[TraceEntry, ...]]:
    """Every rule in ascending order; the first that claims and is available decides.

    Returns the backend, the deciding rule's name, its ``why`` and the trace of every rule.
    """
    trace: list[TraceEntry] = []
    chosen: tuple[type[Accelerator], str, str] | None = None
    for rule, reg in registry.ordered_rules():
        cls = reg.cls
        name = rule_name(rule, cls)
        if chosen is not None:
            trace.append(TraceEntry(rule.order, name, cls.name, rule.why, "not evaluated"))
            continue
        try:
            claims = bool(rule.when(ctx))
        except MisconfigurationError:
            raise
        except Exception as error:
            detail = f"rule raised {type(error).__name__}: {error}"
            trace.append(TraceEntry(rule.order, name, cls.name, rule.why, "failed", detail))
            warnings.append(f"rule {name} of plugin {reg.plugin} failed and was skipped: {error}")
            continue
        if not claims:
            trace.append(TraceEntry(rule.order, name, cls.name, rule.why, "not claimed"))
            continue
        availability = check_availability(cls, ctx, reg.plugin)
        if not availability:
            trace.append(
                TraceEntry(rule.order, name, cls.name, rule.why, "unavailable", availability.reason)
            )
            continue
        trace.append(TraceEntry(rule.order, name, cls.name, rule.why, "claimed"))
        if rule.warning:
            warnings.append(rule.warning)
        chosen = (cls, name, rule.why)
    if chosen is None:
        empty = settings.no_backend_loaded(registry)
        if empty:
            raise MisconfigurationError(f"cardcage cannot choose a backend: {empty}")
        raise MisconfigurationError(
            "no installed backend claims this job (is cardcage-cpu installed and enabled?). "
            f"Install it with `{settings.install_command('cpu')}`, or name a backend with "
            "distributed_backend."
        )
    return chosen[0], chosen[1], chosen[2], tuple(trace)


def no_tpu_backend(
    value: object, trace: tuple[TraceEntry, ...], registry: plugins.Registry
) -> MisconfigurationError:
    """``tpu_cores`` was set but no backend that trains on TPU cores can run here.

    The seed forced its TPU backend whenever ``tpu_cores`` was set and failed without torch-xla;
    quietly training on the CPU instead would hide the mistake for a whole run.
    """
    serving = {name for name, reg in registry.accelerators.items() if reg.cls.uses_tpu_cores}
    reasons = [
        f"{entry.accelerator}: {entry.detail}"
        for entry in trace
        if entry.accelerator in serving and entry.outcome == "unavailable"
    ]
    if reasons:
        why = "no backend that trains on TPU cores can run here (" + "; ".join(reasons) + ")"
        fix = "Run it where torch-xla and a TPU are, or unset tpu_cores to train elsewhere."
    elif serving:
        why = f"none of {sorted(serving)} claimed the job"
        fix = "Name one with distributed_backend, or unset tpu_cores."
    else:
        why = "no installed backend trains on TPU cores"
        fix = f"Install one with `{settings.install_command('tpu')}`, or unset tpu_cores."
    return MisconfigurationError(f"tpu_cores={value!r} is set, but {why}. {fix}")
