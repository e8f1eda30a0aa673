"""The selection engine: which backend runs, in which cluster environment, and why.

:func:`select` is pure: it reads flags, an environment mapping and the GPU count (through
``torch.cuda.is_available()`` and ``torch.cuda.device_count()``), and starts no process,
opens no port and creates no CUDA context.

1. A named ``distributed_backend`` wins. The backend's ``resolve`` may hand the job to
   another backend (a GPU backend with no GPU trains on the CPU, ``ddp_spawn`` inside a
   cluster that made the processes runs as ``ddp``); only then is availability checked.
2. Otherwise every rule of every backend is evaluated in ascending order (ties: backend
   name); the first rule that claims the job and whose backend is available decides.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from cardcage import devices, plugins
from cardcage.accelerator import Accelerator, Availability
from cardcage.environments import ClusterEnvironment, LocalEnvironment, detect_cluster
from cardcage.errors import MisconfigurationError
from cardcage.flags import Flags, did_you_mean, gpus_override, validate_flags

MAX_REDIRECTS = 4


@dataclass(frozen=True)
class SelectionContext:
    """What rules, ``availability`` and ``resolve`` see about the job being placed."""

    env: Mapping[str, str]
    flags: Flags
    gpu_ids: list[int] | None
    num_gpus: int
    tpu_cores: int | list[int] | None
    num_processes: int
    num_nodes: int
    cluster: ClusterEnvironment
    requested: str | None
    requested_as: str | None = None
    cuda_available: bool = False
    device_count: int = 0

    @property
    def processes_created_outside(self) -> bool:
        """Whether a launcher or scheduler already started several processes for this job."""
        return self.cluster.creates_processes and self.cluster.world_size() > 1


@dataclass(frozen=True)
class TraceEntry:
    """One rule's part in a decision."""

    order: int
    rule: str
    accelerator: str
    why: str
    outcome: str  # claimed | not claimed | unavailable | failed | not evaluated
    detail: str = ""


@dataclass(frozen=True)
class Selection:
    """The decision: the backend, the cluster environment, this process's place, and why."""

    accelerator: str
    cluster: str
    rule: str
    gpu_ids: list[int] | None
    root_gpu: int | None
    tpu_cores: int | list[int] | None
    num_processes: int
    num_nodes: int
    world_size: int
    global_rank: int
    local_rank: int
    node_rank: int
    warnings: list[str]
    trace: tuple[TraceEntry, ...] = ()
    why: str = ""
    requested: str | None = None
    master_address: str | None = None
    master_port: int | None = None
    processes_created_outside: bool = False
    flags: Flags = field(default_factory=Flags)
    auto_select_pending: bool = False
    environment: ClusterEnvironment | None = field(default=None, compare=False, repr=False)

    FIELDS = (
        "accelerator",
        "cluster",
        "rule",
        "why",
        "requested",
        "gpu_ids",
        "root_gpu",
        "tpu_cores",
        "num_processes",
        "num_nodes",
        "world_size",
        "global_rank",
        "local_rank",
        "node_rank",
        "master_address",
        "master_port",
        "processes_created_outside",
        "warnings",
    )

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe, keyed by field name, with the rule trace under ``"trace"``."""
        data: dict[str, Any] = {name: getattr(self, name) for name in self.FIELDS}
        data["trace"] = [vars(entry).copy() for entry in self.trace]
        safe: dict[str, Any] = json.loads(json.dumps(data))
        return safe

    def explain(self) -> str:
        """Every registered rule in order, what it did, and the decision."""
        lines = [
            f"selected {self.accelerator!r} by {self.rule}: {self.why}",
            f"cluster {self.cluster!r}: "
            + (
                "the processes were started outside cardcage"
                if self.processes_created_outside
                else "cardcage starts the processes"
            )
            + f"; world size {self.world_size}, {self.num_processes} process(es) per node on "
            f"{self.num_nodes} node(s); this process: global rank {self.global_rank}, local "
            f"rank {self.local_rank}, node rank {self.node_rank}",
            f"devices: gpus {self.gpu_ids if self.gpu_ids else 'none (CPU)'}"
            + (f", root GPU {self.root_gpu}" if self.root_gpu is not None else "")
            + (f", tpu_cores {self.tpu_cores}" if self.tpu_cores is not None else ""),
        ]
        if self.requested:
            lines.append(
                f"distributed_backend={self.requested!r} was named, so rules were not needed:"
            )
        lines.append("rules (ascending order):")
        width = max((len(e.rule) for e in self.trace), default=4)
        acc_width = max((len(e.accelerator) for e in self.trace), default=4)
        for entry in self.trace:
            mark = "->" if entry.outcome == "claimed" and entry.rule == self.rule else "  "
            detail = f" ({entry.detail})" if entry.detail else ""
            lines.append(
                f" {mark} {entry.order:>5}  {entry.accelerator:<{acc_width}}  "
                f"{entry.rule:<{width}}  {entry.outcome:<13}  {entry.why}{detail}"
            )
        if self.warnings:
            lines.append("warnings:")
            lines.extend(f"  - {warning}" for warning in self.warnings)
        return "\n".join(lines)


def _availability(cls: type[Accelerator], ctx: SelectionContext) -> Availability:
    try:
        return cls.availability(ctx)
    except MisconfigurationError:
        raise
    except Exception as error:  # a broken check must not take selection down
        return Availability(False, f"availability check raised {type(error).__name__}: {error}")


def _unknown_backend(name: str, registry: plugins.Registry) -> MisconfigurationError:
    if name in plugins.KNOWN_BACKENDS:
        return MisconfigurationError(
            f"distributed_backend={name!r} is a cardcage backend whose plugin is not "
            f"installed (or was disabled). Install it with `{plugins.install_command(name)}`, "
            "or pick an installed backend: " + ", ".join(registry.names()) + "."
        )
    return MisconfigurationError(
        f"distributed_backend={name!r} is not an installed backend."
        f"{did_you_mean(name, registry.names())} Installed: {', '.join(registry.names())}."
    )


def _lookup(registry: plugins.Registry, name: str) -> type[Accelerator]:
    canonical = registry.canonical(name)
    if canonical is None:
        raise _unknown_backend(name, registry)
    return registry.accelerators[canonical].cls


def select(
    *, env: Mapping[str, str] | None = None, device_count: int | None = None, **flags: Any
) -> Selection:
    """Choose the backend for ``flags`` (the Trainer's) in environment ``env``.

    Args:
        env: stands in for ``os.environ`` (the default).
        device_count: the CUDA devices to assume instead of this machine's (planning a job
            for a compute node from a login node); ``None`` asks torch.
        **flags: ``gpus``, ``tpu_cores``, ``num_processes``, ``num_nodes``,
            ``distributed_backend``, ... as for :class:`cardcage.Trainer`.

    Raises:
        MisconfigurationError: an invalid flag, environment or combination.
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    checked = validate_flags(**flags)
    registry = plugins.registry(environ)
    warnings: list[str] = []

    requested_as = checked.distributed_backend
    requested_cls = _lookup(registry, requested_as) if requested_as else None

    gpus: Any = checked.gpus
    override = gpus_override(environ)
    gpu_flag = "gpus"
    if override is not None:
        gpu_flag, gpus = override
    if device_count is None:
        device_count = devices.cuda_device_count()
    auto_pending = False
    if checked.auto_select_gpus and isinstance(gpus, int):
        gpu_ids, auto_pending = _auto_select(gpus, device_count)
    else:
        gpu_ids = devices.parse_gpu_ids(gpus, device_count, flag=gpu_flag)
    tpu_cores = devices.parse_tpu_cores(checked.tpu_cores)
    if tpu_cores is not None and requested_cls is not None and not requested_cls.uses_tpu_cores:
        raise MisconfigurationError(
            f"tpu_cores={checked.tpu_cores!r} is set, but distributed_backend="
            f"{requested_as!r} does not train on TPU cores. Unset distributed_backend (or "
            "set it to 'tpu'), or unset tpu_cores."
        )

    ctx = SelectionContext(
        env=environ,
        flags=checked,
        gpu_ids=gpu_ids,
        num_gpus=len(gpu_ids or []),
        tpu_cores=tpu_cores,
        num_processes=checked.num_processes,
        num_nodes=checked.num_nodes,
        cluster=LocalEnvironment(environ, 1),
        requested=requested_cls.name if requested_cls else None,
        requested_as=requested_as,
        cuda_available=device_count > 0,
        device_count=device_count,
    )
    per_node = (requested_cls or Accelerator).processes_per_node(ctx)
    cluster, notes = detect_cluster(
        environ, checked.num_nodes * per_node, checked.num_nodes, registry.environments
    )
    warnings.extend(notes)
    ctx = replace(ctx, cluster=cluster)

    if requested_cls is not None:
        chosen, ctx, rule, why = _resolve_named(requested_cls, ctx, registry, warnings)
        trace = tuple(
            TraceEntry(r.order, _rule_name(r, reg.cls), reg.cls.name, r.why, "not evaluated")
            for r, reg in registry.ordered_rules()
        )
    else:
        chosen, rule, why, trace = _run_rules(ctx, registry, warnings)
        if tpu_cores is not None and not chosen.uses_tpu_cores:
            raise _no_tpu_backend(checked.tpu_cores, trace, registry)

    outside = cluster.creates_processes
    # a launcher that started the processes knows how many it put on this node
    per_node = (outside and cluster.local_world_size()) or chosen.processes_per_node(ctx)
    global_rank, local_rank, node_rank = (
        cluster.global_rank(),
        cluster.local_rank(),
        cluster.node_rank(),
    )  # read (and checked) before the rendezvous, whose error would hide a bad rank
    if (
        outside
        and chosen.needs_rendezvous
        and not cluster.provides_rendezvous
        and cluster.master_port() is None
    ):
        raise MisconfigurationError(
            f"the processes were started by {cluster.name!r} (world size "
            f"{cluster.world_size()}), which gives no MASTER_ADDR/MASTER_PORT, and "
            f"{chosen.name!r} needs them for torch.distributed to connect its ranks. Export "
            "MASTER_ADDR (the first host) and MASTER_PORT (a free port) to every process, or "
            "use the launcher's own backend (horovodrun/mpirun: "
            f"`{plugins.install_command('horovod')}`)."
        )
    world_size = cluster.world_size() if outside else checked.num_nodes * per_node
    return Selection(
        accelerator=chosen.name,
        cluster=cluster.name,
        rule=rule,
        why=why,
        requested=ctx.requested,
        gpu_ids=ctx.gpu_ids,
        root_gpu=devices.determine_root_gpu_device(ctx.gpu_ids),
        tpu_cores=tpu_cores,
        num_processes=per_node,
        num_nodes=checked.num_nodes,
        world_size=world_size,
        global_rank=global_rank,
        local_rank=local_rank,
        node_rank=node_rank,
        warnings=warnings,
        trace=trace,
        master_address=cluster.master_address(),
        master_port=cluster.master_port(),
        processes_created_outside=outside,
        flags=checked,
        auto_select_pending=auto_pending,
        environment=cluster,
    )


def _no_tpu_backend(
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
        fix = f"Install one with `{plugins.install_command('tpu')}`, or unset tpu_cores."
    return MisconfigurationError(f"tpu_cores={value!r} is set, but {why}. {fix}")


def _auto_select(gpus: int, device_count: int) -> tuple[list[int] | None, bool]:
    """GPUs for ``auto_select_gpus``: ranked through NVML now, else probed at training start."""
    if gpus == 0:
        devices.pick_multiple_gpus(0, device_count=device_count)  # raises with the message
    free = devices._nvml_free_memory()
    if free is not None:
        return devices.pick_multiple_gpus(
            gpus, free_memory=lambda: free, device_count=device_count
        ), False
    return devices.parse_gpu_ids(gpus, device_count), True


def _rule_name(rule: Any, cls: type[Accelerator]) -> str:
    return str(rule.name or f"{cls.name}.{rule.order}")


def _resolve_named(
    cls: type[Accelerator],
    ctx: SelectionContext,
    registry: plugins.Registry,
    warnings: list[str],
) -> tuple[type[Accelerator], SelectionContext, str, str]:
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
                f"`{plugins.install_command(resolution.accelerator)}`, or change the flags."
            )
        current = _lookup(registry, resolution.accelerator)
        # Only the named backend's own checks apply on the first hop; the next one resolves
        # as if it had been named itself.
        ctx = replace(ctx, requested=current.name, requested_as=current.name)
    availability = _availability(current, ctx)
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


def _run_rules(
    ctx: SelectionContext, registry: plugins.Registry, warnings: list[str]
) -> tuple[type[Accelerator], str, str, tuple[TraceEntry, ...]]:
    trace: list[TraceEntry] = []
    chosen: tuple[type[Accelerator], str, str] | None = None
    for rule, reg in registry.ordered_rules():
        cls = reg.cls
        name = _rule_name(rule, cls)
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
        availability = _availability(cls, ctx)
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
        raise MisconfigurationError(
            "no installed backend claims this job (is cardcage-cpu installed and enabled?). "
            f"Install it with `{plugins.install_command('cpu')}`, or name a backend with "
            "distributed_backend."
        )
    return chosen[0], chosen[1], chosen[2], tuple(trace)
