"""The types of a selection: what rules see (:class:`SelectionContext`), what each rule did
(:class:`TraceEntry`) and the decision (:class:`Selection`).

They sit low in the core, below the backends that read them and the engine that makes them
(:mod:`cardcage.selection.engine`, :mod:`cardcage.selection.rules`). ``cardcage`` and
``cardcage.sdk`` make them public.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cardcage.config.flags import Flags
from cardcage.environments.base import ClusterEnvironment

__all__ = ["Selection", "SelectionContext", "TraceEntry"]


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
