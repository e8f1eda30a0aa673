"""The selection engine: which backend runs, in which cluster environment, and why.

:func:`select` is pure: it reads flags, an environment mapping and the GPU count (through
``torch.cuda.is_available()`` and ``torch.cuda.device_count()``), and starts no process,
opens no port and creates no CUDA context.

1. A named ``distributed_backend`` wins. The backend's ``resolve`` may hand the job to
   another backend (a GPU backend with no GPU trains on the CPU, ``ddp_spawn`` inside a
   cluster that made the processes runs as ``ddp``); only then is availability checked.
2. Otherwise every rule of every backend is evaluated in ascending order (ties: backend
   name); the first rule that claims the job and whose backend is available decides.

Both steps are :mod:`cardcage.selection.rules`'s; ``SelectionContext`` and ``TraceEntry`` live there
and are public here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from cardcage import devices
from cardcage.backend.accelerator import Accelerator
from cardcage.backend.selection_types import Selection, SelectionContext
from cardcage.config.flags import check_sync_batchnorm, gpus_override, validate_flags
from cardcage.config.variables import check_variables
from cardcage.environments import inherited
from cardcage.environments.base import ClusterEnvironment
from cardcage.environments.builtin import LocalEnvironment, detect_cluster
from cardcage.errors import MisconfigurationError
from cardcage.loggers import check as check_logger_flag
from cardcage.plugins import manager as plugins
from cardcage.plugins import settings
from cardcage.selection.rules import (
    lookup_backend,
    no_tpu_backend,
    not_evaluated,
    resolve_named,
    run_rules,
)


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
    # A child of a training process (started from a callback) inherits its rank variables:
    # they are the rank's, not this process's, which is a plain local one.
    environ = inherited.effective(os.environ if env is None else env)
    checked = validate_flags(**flags)
    check_variables(environ)  # every CARDCAGE_* value but CARDCAGE_GPUS (read below)
    registry = plugins.registry(environ)
    # a logger name must be registered (the Trainer builds it from the same registry)
    check_logger_flag(flags.get("logger", True), checked.default_root_dir, registry)
    warnings: list[str] = []

    requested_as = checked.distributed_backend
    requested_cls = lookup_backend(registry, requested_as) if requested_as else None

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
        chosen, ctx, rule, why = resolve_named(requested_cls, ctx, registry, warnings)
        trace = not_evaluated(registry)
    else:
        chosen, rule, why, trace = run_rules(ctx, registry, warnings)
        if tpu_cores is not None and not chosen.uses_tpu_cores:
            raise no_tpu_backend(checked.tpu_cores, trace, registry)

    outside = cluster.creates_processes
    # a launcher that started the processes knows how many it put on this node
    per_node = (outside and cluster.local_world_size()) or chosen.processes_per_node(ctx)
    global_rank, local_rank, node_rank = (
        cluster.global_rank(),
        cluster.local_rank(),
        cluster.node_rank(),
    )  # read (and checked) before the rendezvous, whose error would hide a bad rank
    if outside:
        _check_ranks(cluster, global_rank, local_rank, node_rank)
    if outside and chosen.needs_rendezvous and cluster.master_port() is None:
        if cluster.provides_rendezvous:
            raise MisconfigurationError(
                f"the processes were started by {cluster.name!r} (world size "
                f"{cluster.world_size()}), but MASTER_PORT is not set, and {chosen.name!r} "
                "needs it for torch.distributed to connect its ranks. Export MASTER_PORT (a "
                "free port, the same on every process) and MASTER_ADDR (rank 0's host) to "
                "every process, or fix the launcher (or its cluster environment's "
                "master_port()) so that it sets them."
            )
        raise MisconfigurationError(
            f"the processes were started by {cluster.name!r} (world size "
            f"{cluster.world_size()}), which gives no MASTER_ADDR/MASTER_PORT, and "
            f"{chosen.name!r} needs them for torch.distributed to connect its ranks. Export "
            "MASTER_ADDR (the first host) and MASTER_PORT (a free port) to every process, or "
            "use the launcher's own backend (horovodrun/mpirun: "
            f"`{settings.install_command('horovod')}`)."
        )
    if (
        requested_cls is None  # (a backend named for one process says it ignores the flag)
        and not outside
        and not ctx.gpu_ids
        and tpu_cores is None
        and per_node < checked.num_processes
    ):
        raise _too_few_processes(checked.num_processes, per_node, chosen.name, registry)
    world_size = cluster.world_size() if outside else checked.num_nodes * per_node
    # What the chosen backend and cluster refuse: checked here, not in the Trainer, so that
    # select and `cardcage explain` refuse exactly what Trainer(**flags) refuses.
    check_sync_batchnorm(checked, ctx.gpu_ids, chosen.name)
    cluster.requeue_signal()  # a bad CARDCAGE_REQUEUE_SIGNAL for this cluster raises
    selection = Selection(
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
    chosen.check_selection(selection, environ)
    return selection


def _too_few_processes(
    asked: int, given: int, chosen: str, registry: plugins.Registry
) -> MisconfigurationError:
    """``num_processes`` asks for more processes than the backend the rules chose starts:
    the backend that would start them is not installed or not loaded."""
    spawn = "ddp_spawn"
    if registry.canonical(spawn) is None:
        why = settings.why_not_loaded(registry, spawn)
        how = (
            f"the backend that starts them, {spawn!r}, is not loaded: {why}"
            if why
            else f"the backend that starts them, {spawn!r}, is not installed: "
            f"`{settings.install_command(spawn)}`"
        )
    else:
        how = f"name distributed_backend={spawn!r} (or 'ddp') to start them"
    return MisconfigurationError(
        f"num_processes={asked} asks for {asked} processes, but the only backend that fits, "
        f"{chosen!r}, runs {given} per node; "
        f"{how}. Or set num_processes={given}."
    )


def _check_ranks(
    cluster: ClusterEnvironment, global_rank: int, local_rank: int, node_rank: int
) -> None:
    """The ranks a cluster environment gives, checked against its sizes.

    The built-in environments name the variable that is out of range themselves; this catches
    what a plugin's environment lets through, naming the variables it reads."""
    world = cluster.world_size()
    local_world = cluster.local_world_size()
    problem = None
    if not 0 <= global_rank < world:
        problem = f"global rank {global_rank} for a world size of {world}"
    elif local_rank < 0 or (local_world is not None and local_rank >= local_world):
        of = f" of {local_world} process(es) on this node" if local_world is not None else ""
        problem = f"local rank {local_rank}{of}"
    elif local_world is not None and not 0 < local_world <= world:
        problem = f"{local_world} process(es) on this node for a world size of {world}"
    elif node_rank < 0:
        problem = f"node rank {node_rank}"
    if problem is not None:
        raise MisconfigurationError(
            f"the {cluster.name!r} cluster environment gives {problem}, which cannot be. Fix "
            f"the launcher's variables ({', '.join(cluster.variables) or 'see its docs'}) so "
            "that every rank is in 0..size-1."
        )


def _auto_select(gpus: int, device_count: int) -> tuple[list[int] | None, bool]:
    """GPUs for ``auto_select_gpus``: ranked through NVML now, else probed at training start."""
    if gpus == 0:
        devices.pick_multiple_gpus(0, device_count=device_count)  # raises with the message
    free = devices.nvml_free_memory()
    if free is not None:
        return devices.pick_multiple_gpus(
            gpus, free_memory=lambda: free, device_count=device_count
        ), False
    return devices.parse_gpu_ids(gpus, device_count), True


def probe_pending_gpus(selection: Selection) -> Selection:
    """``auto_select_gpus`` without NVML: probe the GPUs, as Lightning 1.0 did.

    Allocating on a GPU creates a CUDA context, which :func:`select` must not, so the choice
    waits until training starts (``fit``). The ids go to ``CARDCAGE_GPUS``, so that
    processes started later take the same GPUs instead of probing again. Returns
    ``selection`` itself when nothing was pending.
    """
    if not selection.auto_select_pending or selection.processes_created_outside:
        return selection
    count = len(selection.gpu_ids or [])
    ids = devices.pick_multiple_gpus(count, free_memory=lambda: None, probe=devices.probe_gpu)
    os.environ["CARDCAGE_GPUS"] = ",".join(map(str, ids))
    return replace(
        selection,
        gpu_ids=ids,
        root_gpu=devices.determine_root_gpu_device(ids),
        auto_select_pending=False,
    )
