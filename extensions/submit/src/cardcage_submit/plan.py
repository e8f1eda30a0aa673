"""The job description (:class:`JobDescription`, the fields of
:class:`~cardcage_submit.submission.SlurmJob`) and its validation into a :class:`Plan`: the
layout the selection rules choose for the Trainer flags (processes per node, checked
against what the Trainer inside the job will see) and submitit's parameters.

This module imports nothing of the submission: :mod:`~cardcage_submit.submission` builds on
it (``SlurmJob`` adds ``dry_run`` and ``submit`` to the description), never the reverse."""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import cardcage
from cardcage.sdk import (
    FLAG_NAMES,
    INTERACTIVE_SLURM_JOB_NAMES,
    REQUEUE_SIGNAL,
    MisconfigurationError,
    parse_signal,
)
from cardcage_submit.grid import parse_value

if TYPE_CHECKING:
    from cardcage.sdk import Selection

#: sbatch options cardcage sets itself; ``sbatch=`` may not override them.
RESERVED_SBATCH = frozenset(
    {
        "array",
        "error",
        "job-name",
        "nodes",
        "ntasks",
        "ntasks-per-node",
        "output",
        "requeue",
        "signal",
        "time",
        "partition",
        "gpus-per-node",
    }
)
# The submitter's variables that would steer the job's cluster detection; planning ignores
# them (the job gets SLURM's own).
_CLUSTER_PREFIXES = (
    *("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "TORCHELASTIC_", "OMPI_", "PMI_", "PMIX_"),
    "HOROVOD_",
)
_CLUSTER_NAMES = frozenset(
    {
        "WORLD_SIZE",
        "LOCAL_RANK",
        "NODE_RANK",
        "GROUP_RANK",
        "RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)


def parse_time(value: object) -> int:
    """A SLURM time limit in whole minutes: 90, ``"90"``, ``"01:30:00"``, ``"1-12"``, ..."""
    problem = MisconfigurationError(
        f"time={value!r} (--time) is not a SLURM time limit. Use minutes (90), 'MM:SS', "
        "'HH:MM:SS' ('01:30:00'), 'D-HH', 'D-HH:MM' or 'D-HH:MM:SS' ('1-00:00:00')."
    )
    if isinstance(value, bool):
        raise problem
    if isinstance(value, int):
        if value < 1:
            raise problem
        return value
    if not isinstance(value, str):
        raise problem
    text = value.strip()
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not match:
        raise problem
    days_text, first, second, third = match.groups()
    days = int(days_text or 0)
    numbers = [int(part) for part in (first, second, third) if part is not None]
    if days_text is not None:  # D-HH, D-HH:MM, D-HH:MM:SS
        hours, minutes, seconds = [*numbers, 0, 0][:3]
    elif len(numbers) == 1:  # MM
        hours, minutes, seconds = 0, numbers[0], 0
    elif len(numbers) == 2:  # MM:SS
        hours, minutes, seconds = 0, numbers[0], numbers[1]
    else:  # HH:MM:SS
        hours, minutes, seconds = numbers
    total = days * 24 * 60 + hours * 60 + minutes + math.ceil(seconds / 60)
    if total < 1:
        raise problem
    return total


def _strings(name: str, value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Sequence) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise MisconfigurationError(
        f"{name}={value!r} is not valid: {name} must be a list of strings (one shell line or "
        "argument each)."
    )


@dataclass
class JobDescription:
    """The fields of a :class:`~cardcage_submit.submission.SlurmJob` (documented there) and
    their validation, :meth:`plan`; ``SlurmJob`` adds ``dry_run`` and ``submit``."""

    nodes: int = 1
    gpus_per_node: int = 0
    time: int | str = 60
    partition: str | None = None
    job_name: str = "cardcage"
    modules: Sequence[str] = ()
    setup: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    master_port: int | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    requeue: bool = True
    requeue_signal: str = "USR1"
    signal_delay_s: int = 90
    sbatch: Mapping[str, str | int | bool] = field(default_factory=dict)
    srun_args: Sequence[str] = ("--kill-on-bad-exit=1",)
    python: str | None = None
    trainer: Mapping[str, Any] = field(default_factory=dict)

    def plan(self) -> Plan:
        """Validate the description and decide the layout (raises MisconfigurationError)."""
        return _plan(self)


@dataclass(frozen=True)
class Plan:
    """A validated :class:`JobDescription`: the layout the selection rules chose, and submitit's
    parameters (without the per-point setup lines)."""

    job: JobDescription
    trainer_flags: dict[str, Any]
    accelerator: str
    rule: str
    processes_per_node: int
    time_min: int
    requeue_signal: str | None
    parameters: dict[str, Any]
    warnings: tuple[str, ...] = ()

    @property
    def tasks(self) -> int:
        return self.job.nodes * self.processes_per_node

    def describe(self) -> str:
        return (
            f"{self.accelerator} on {self.job.nodes} node(s) x {self.processes_per_node} "
            f"process(es) per node (processes per node from rule {self.rule})"
        )


def _planning_env(job: JobDescription) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(_CLUSTER_PREFIXES) and key not in _CLUSTER_NAMES
    }
    env.update(job.env)
    return env


def _positive(name: str, value: object, *, zero: bool = False, what: str = "") -> int:
    low = 0 if zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = "a non-negative int" if zero else "a positive int"
        raise MisconfigurationError(
            f"{name}={value!r} (--{name.replace('_', '-')}) is not valid: it must be {kind}{what}."
        )
    return value


def _did_you_mean(name: str, choices: Sequence[str]) -> str:
    """`` Did you mean 'x'?`` (the closest of ``choices``) or an empty string."""
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def _trainer_flags(job: JobDescription) -> tuple[dict[str, Any], int]:
    """The Trainer flags of the job, and the GPUs per node to ask SLURM for."""
    if not isinstance(job.trainer, Mapping):
        raise MisconfigurationError(
            f"trainer={job.trainer!r} is not valid: pass the Trainer flags as a mapping, e.g. "
            "trainer={'num_processes': 2, 'max_epochs': 3}."
        )
    flags = dict(job.trainer)
    unknown = [name for name in flags if name not in FLAG_NAMES]
    if unknown:
        raise MisconfigurationError(
            f"trainer={{{unknown[0]!r}: ...}}: {unknown[0]!r} is not a Trainer flag."
            f"{_did_you_mean(unknown[0], FLAG_NAMES)} Known flags: {', '.join(FLAG_NAMES)}."
        )
    num_nodes = flags.get("num_nodes")
    if num_nodes is not None and num_nodes != job.nodes:
        raise MisconfigurationError(
            f"the Trainer flag num_nodes={num_nodes!r} differs from nodes={job.nodes} (--nodes): "
            "the job's processes would not match what SLURM starts. Set one of them; nodes "
            "sets num_nodes."
        )
    flags["num_nodes"] = job.nodes
    gpus = flags.get("gpus")
    per_node = job.gpus_per_node
    if isinstance(gpus, str) and "," in gpus:
        raise MisconfigurationError(
            f"the Trainer flag gpus={gpus!r} names GPU ids, but in a SLURM job SLURM chooses "
            "the GPUs (CUDA_VISIBLE_DEVICES). Set gpus_per_node (--gpus-per-node) to the "
            "count instead."
        )
    if isinstance(gpus, str):
        gpus = parse_value(gpus)
    if gpus in (None, 0):
        if per_node:
            flags["gpus"] = per_node
        elif gpus == 0:
            flags.pop("gpus")
    elif gpus == -1:
        if not per_node:
            raise MisconfigurationError(
                "the Trainer flag gpus=-1 (all GPUs) needs gpus_per_node (--gpus-per-node): "
                "SLURM must be asked for a number of GPUs per node."
            )
        flags["gpus"] = per_node
    elif isinstance(gpus, int) and not isinstance(gpus, bool):
        if per_node and gpus != per_node:
            raise MisconfigurationError(
                f"the Trainer flag gpus={gpus} differs from gpus_per_node={per_node} "
                "(--gpus-per-node). Set one of them; gpus_per_node sets gpus."
            )
        flags["gpus"] = gpus
        per_node = gpus
    return flags, per_node


def _plan(job: JobDescription) -> Plan:
    nodes = _positive("nodes", job.nodes)
    gpus_per_node = _positive("gpus_per_node", job.gpus_per_node, zero=True)
    time_min = parse_time(job.time)
    if not isinstance(job.job_name, str) or not re.fullmatch(r"[A-Za-z0-9._+-]+", job.job_name):
        raise MisconfigurationError(
            f"job_name={job.job_name!r} (--job-name) is not valid: use letters, digits and "
            "._+- only."
        )
    if job.job_name in INTERACTIVE_SLURM_JOB_NAMES:
        raise MisconfigurationError(
            f"job_name={job.job_name!r} (--job-name) is the name of an interactive shell: "
            "cardcage would not let SLURM manage the job's tasks and would start processes "
            "itself. Use another name."
        )
    if job.partition is not None and (not isinstance(job.partition, str) or not job.partition):
        raise MisconfigurationError(
            f"partition={job.partition!r} (--partition) is not valid: give a partition name, "
            "or None for the cluster's default."
        )
    modules = _strings("modules", job.modules)
    setup = _strings("setup", job.setup)
    srun_args = _strings("srun_args", job.srun_args)
    if not isinstance(job.env, Mapping) or not all(
        isinstance(key, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) for key in job.env
    ):
        raise MisconfigurationError(
            f"env={job.env!r} (--env) is not valid: give a mapping of variable names (letters, "
            "digits, _) to values."
        )
    if job.master_port is not None and (
        isinstance(job.master_port, bool)
        or not isinstance(job.master_port, int)
        or not 0 < job.master_port < 65536
    ):
        raise MisconfigurationError(
            f"master_port={job.master_port!r} (--master-port) is not a TCP port. Use "
            "1..65535, or None for 15000 + the last four digits of the job id."
        )
    signal_name: str | None = None
    if job.requeue:
        parsed = parse_signal(str(job.requeue_signal), "requeue_signal")
        if parsed is None:
            raise MisconfigurationError(
                f"requeue_signal={job.requeue_signal!r} (--requeue-signal) turns the signal "
                "off, but requeue=True. Set requeue=False (--no-requeue) to submit without "
                "checkpoint-and-requeue, or name a signal such as USR1."
            )
        signal_name = parsed.name.removeprefix("SIG")
        delay = _positive("signal_delay_s", job.signal_delay_s)
        if delay >= time_min * 60:
            raise MisconfigurationError(
                f"signal_delay_s={delay} (--signal-delay-s) is not below the time limit "
                f"time={job.time!r} ({time_min * 60} s): the signal would come before training "
                "starts. Give the job more time, or a shorter delay."
            )
    extras: dict[str, str | int | bool] = {}
    if not isinstance(job.sbatch, Mapping):
        raise MisconfigurationError(
            f"sbatch={job.sbatch!r} (--sbatch) is not valid: give a mapping of sbatch "
            "options to values, e.g. {'account': 'proj', 'exclusive': True}."
        )
    for key, value in job.sbatch.items():
        option = str(key).lstrip("-").replace("_", "-")
        if not re.fullmatch(r"[a-z][a-z0-9-]*", option):
            raise MisconfigurationError(
                f"sbatch option {key!r} (--sbatch) is not an sbatch option name. Use the long "
                "name without dashes, e.g. account=proj."
            )
        if option in RESERVED_SBATCH:
            raise MisconfigurationError(
                f"sbatch option {option}={value!r} (--sbatch) is set by cardcage: use the "
                "SlurmJob field (nodes, gpus_per_node, time, partition, job_name, requeue) "
                "instead; --ntasks-per-node comes from the selection rules."
            )
        if not isinstance(value, (str, int, bool)) or value is False:
            raise MisconfigurationError(
                f"sbatch option {option}={value!r} (--sbatch) is not valid: give a string, a "
                "number, or True for a flag without a value."
            )
        extras[option] = value
    for name in ("cpus_per_task",):
        value = getattr(job, name)
        if value is not None:
            _positive(name, value)
    if job.mem is not None and not re.fullmatch(r"\d+[KMGT]?B?", str(job.mem)):
        raise MisconfigurationError(
            f"mem={job.mem!r} (--mem) is not an sbatch memory size. Use e.g. '32G' or '0' "
            "(all of a node's memory)."
        )

    flags, gpus_per_node = _trainer_flags(job)
    base = _planning_env(job)
    # Selection as a compute node with gpus_per_node GPUs sees it (the login node may have none)
    launching = cardcage.select(env=base, device_count=gpus_per_node, **flags)
    per_node = launching.num_processes
    inside = {
        **base,
        "SLURM_JOB_ID": "1",
        "SLURM_JOB_NAME": job.job_name,
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NTASKS": str(nodes * per_node),
        "SLURM_NTASKS_PER_NODE": str(per_node),
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "node1",
        REQUEUE_SIGNAL: signal_name or "none",
    }
    in_job: Selection = cardcage.select(env=inside, device_count=gpus_per_node, **flags)
    if in_job.cluster != "slurm" or in_job.world_size != nodes * per_node:
        said = " ".join(in_job.warnings)
        raise MisconfigurationError(
            f"with {nodes} node(s) x {per_node} task(s) per node, the Trainer in the job would "
            f"not take its processes from SLURM (it sees cluster {in_job.cluster!r}). {said} "
            "Check the Trainer flags against nodes and gpus_per_node."
        )

    parameters: dict[str, Any] = {
        "job_name": job.job_name,
        "time": time_min,
        "nodes": nodes,
        "ntasks_per_node": per_node,
        "srun_args": list(srun_args),
        "stderr_to_stdout": False,
    }
    if job.partition:
        parameters["partition"] = job.partition
    if gpus_per_node and "gres" not in extras:
        parameters["gpus_per_node"] = gpus_per_node
    if job.cpus_per_task is not None:
        parameters["cpus_per_task"] = job.cpus_per_task
    if job.mem is not None:
        parameters["mem"] = str(job.mem)
    if signal_name is not None:
        parameters["signal_delay_s"] = job.signal_delay_s
        extras["signal"] = f"{signal_name}@{job.signal_delay_s}"
        extras["requeue"] = True
    parameters["additional_parameters"] = extras
    normalized = replace(
        job, modules=modules, setup=setup, srun_args=srun_args, gpus_per_node=gpus_per_node
    )
    return Plan(
        job=normalized,
        trainer_flags=flags,
        accelerator=in_job.accelerator,
        rule=launching.rule,
        processes_per_node=per_node,
        time_min=time_min,
        requeue_signal=signal_name,
        parameters=parameters,
        warnings=tuple(launching.warnings),
    )
