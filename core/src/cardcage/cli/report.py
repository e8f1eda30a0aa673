"""What ``cardcage plugins`` and ``cardcage env`` report."""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import platform
import sys
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from cardcage import devices
from cardcage.backend.selection_types import SelectionContext
from cardcage.config.flags import Flags
from cardcage.environments.builtin import LocalEnvironment, detect_cluster
from cardcage.plugins import manager as plugins
from cardcage.selection.rules import check_availability


def listing_context(env: Mapping[str, str]) -> SelectionContext:
    """The context of a job with default flags, used to judge availability in listings."""
    count = devices.cuda_device_count()
    return SelectionContext(
        env=env,
        flags=Flags(),
        gpu_ids=None,
        num_gpus=0,
        tpu_cores=None,
        num_processes=1,
        num_nodes=1,
        cluster=LocalEnvironment(env, 1),
        requested=None,
        cuda_available=count > 0,
        device_count=count,
    )


def backend_rows(env: Mapping[str, str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One row per installed backend (availability included), and every plugin record."""
    registry = plugins.registry(env)
    ctx = listing_context(env)
    rows = []
    for name in sorted(registry.accelerators):
        reg = registry.accelerators[name]
        # Named on stderr while it runs long (a listing may wait on a device or a network);
        # select() itself starts no thread, and so times nothing.
        with plugins.named_while_slow(plugins.check_label(reg.plugin, name)) as timed:
            availability = check_availability(reg.cls, ctx)
        rows.append(
            {
                "name": name,
                "aliases": list(reg.cls.aliases),
                "plugin": reg.plugin,
                "distribution": reg.distribution,
                "version": reg.version,
                "available": availability.available,
                "reason": availability.reason,
                "hint": availability.hint,
                "status": availability.describe(),
                "check_seconds": round(timed.seconds, 3),  # how long its availability check took
                "rules": [{"order": r.order, "name": r.name, "why": r.why} for r in reg.cls.rules],
            }
        )
    return rows, [asdict(record) for record in registry.plugins]


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def environment_report(env: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """The text a bug report needs: versions, devices, plugins, the cluster environment."""
    import torch

    registry = plugins.registry(env)
    report: dict[str, dict[str, str]] = {
        "system": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "executable": sys.executable,
        },
        "versions": {
            "cardcage-core": _version("cardcage-core"),
            "torch": torch.__version__,
            "pluggy": _version("pluggy"),
            "horovod": _version("horovod"),
            "torch-xla": _version("torch-xla")
            if importlib.util.find_spec("torch_xla")
            else "not installed",
        },
        "devices": {
            "cuda available": str(torch.cuda.is_available()),
            "cuda devices": str(devices.cuda_device_count()),
            "torch cuda build": str(torch.version.cuda),
            "nvml (pynvml)": "present" if importlib.util.find_spec("pynvml") else "absent",
            "CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES", "unset"),
            "torch threads": str(torch.get_num_threads()),
        },
        "plugins": {
            record.name: f"{record.distribution or '-'} {record.version or ''} "
            f"{record.status}{': ' + record.error if record.error else ''}".strip()
            for record in registry.plugins
        },
    }
    cluster, notes = detect_cluster(env, 1, 1, registry.environments)
    section = {"detected": cluster.name}
    names = sorted(
        {v for cls in registry.environments for v in cls.variables}
        | set(LocalEnvironment.variables)
    )
    section.update({name: env[name] for name in names if name in env})
    for index, note in enumerate(notes):
        section[f"note {index + 1}"] = note
    report["cluster environment"] = section
    hooks = registry.hooks
    if hooks is not None:
        for extra in hooks.cardcage_env_report():
            for key, value in (extra or {}).items():
                report.setdefault("plugin reports", {})[str(key)] = str(value)
    return report
