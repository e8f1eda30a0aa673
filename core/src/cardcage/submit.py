"""Submitting training to SLURM from Python or the command line: one job per grid point.

Built on submitit (``pip install 'cardcage[submit]'``), which writes each job's sbatch
script, pickles the function and its arguments, runs it in every task with
``srun ... python -m submitit.core._submit FOLDER`` and pickles each task's return value.
cardcage adds what training jobs need on top of it:

- ``--ntasks-per-node`` is the number of processes per node the selection rules pick for the
  Trainer flags (the GPUs of a node for ``ddp``, 1 for ``ddp2``, ``num_processes`` on the
  CPU), checked against what the Trainer inside the job will see: SLURM manages the tasks
  (``SLURM_NTASKS`` equals the world size), so each process takes its ranks from SLURM;
- checkpoint-and-requeue: ``--requeue`` and ``--signal=USR1@90`` (cardcage's requeue signal,
  exported to the job as ``CARDCAGE_REQUEUE_SIGNAL``), and submitit's own signal handlers
  are taken out of the way so that cardcage's handler alone acts (see docs/submitting.md);
- a rendezvous port per job (``MASTER_PORT`` = 15000 + the last four digits of the job id),
  modules to load and setup commands;
- a grid search: one job per combination of hyperparameters, each in its own folder with its
  logs, the hyperparameters it ran with (``hparams.json``) and its result (``result.json``
  and submitit's result pickles), and a manifest (``grid.json``) from which
  :meth:`Grid.load` (or ``cardcage jobs FOLDER``) finds the jobs again: status through
  ``squeue``/``scontrol``/``sacct``, results, cancellation through ``scancel``.

submitit is imported only when a job is planned or submitted: ``import cardcage`` never
imports it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import json
import math
import os
import re
import runpy
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cardcage.environments import INTERACTIVE_SLURM_JOB_NAMES, REQUEUE_SIGNAL, parse_signal
from cardcage.errors import MisconfigurationError

if TYPE_CHECKING:
    from cardcage.selection import Selection
    from cardcage.trainer import Trainer

__all__ = [
    "Grid",
    "GridJob",
    "GridResult",
    "PlannedJob",
    "Run",
    "SlurmJob",
    "SubmissionError",
    "current_run",
    "dry_run",
    "expand_grid",
    "parse_grid_option",
    "submit",
]

#: What ``pip install 'cardcage[submit]'`` installs.
SUBMITIT_REQUIREMENT = "submitit>=1.5.4,<1.6"
#: Inside a job: the path of the grid point's ``hparams.json`` (:func:`current_run`).
RUN_VARIABLE = "CARDCAGE_SUBMIT_RUN"
MANIFEST = "grid.json"
POINT_FILE = "hparams.json"
RESULT_FILE = "result.json"
#: The states after which a job never runs again.
TERMINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "REVOKED",
        "TIMEOUT",
    }
)
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

Value = bool | int | float | str


class SubmissionError(RuntimeError):
    """sbatch (or another SLURM command) refused or failed; the message says what it said."""


# -- hyperparameter grids -----------------------------------------------------------------


def parse_value(text: str) -> Value:
    """A grid value from the command line: ``"16"`` → 16, ``"1e-3"`` → 0.001, else the text."""
    stripped = text.strip()
    for kind in (int, float):
        try:
            return kind(stripped)  # type: ignore[no-any-return]
        except ValueError:
            pass
    return stripped


def parse_grid_option(text: str) -> tuple[str, list[Value]]:
    """``"lr=1e-3,1e-2"`` → ``("lr", [0.001, 0.01])`` (the ``--grid`` option)."""
    name, equals, values = text.partition("=")
    name = name.strip()
    if not equals or not name:
        raise MisconfigurationError(
            f"--grid {text!r} is not NAME=VALUES. Write it like --grid lr=1e-3,1e-2 (one "
            "--grid per hyperparameter)."
        )
    pieces = [piece for piece in values.split(",") if piece.strip()]
    if not pieces:
        raise MisconfigurationError(
            f"--grid {text!r} gives no value for {name!r}. List them after '=', separated by "
            "commas: --grid lr=1e-3,1e-2."
        )
    return name, [parse_value(piece) for piece in pieces]


def _check_name(name: object, source: str) -> str:
    from cardcage.flags import FLAG_NAMES

    if not isinstance(name, str) or not name.isidentifier():
        raise MisconfigurationError(
            f"{source}: hyperparameter name {name!r} is not a Python identifier. Use names "
            "like lr or num_layers (they become keyword arguments, or --NAME options of a "
            "script)."
        )
    if name in FLAG_NAMES:
        raise MisconfigurationError(
            f"{source}: {name!r} is a Trainer flag, not a hyperparameter: a grid over it would "
            f"change the job's layout. Set it once (trainer={{{name!r}: ...}}, or --"
            f"{name.replace('_', '-')} on the command line) and submit one grid per value."
        )
    return name


def expand_grid(
    grid: Mapping[str, Sequence[Value] | Value] | Sequence[Mapping[str, Value]] | None,
) -> list[dict[str, Value]]:
    """Every combination, the first hyperparameter varying slowest (the seed's order).

    ``{"lr": [1e-3, 1e-2], "layers": [16, 32]}`` gives ``lr=1e-3, layers=16``, then
    ``layers=32``, then ``lr=1e-2`` with each. A scalar is a one-value list. A sequence of
    mappings is taken as the points themselves. ``None`` or ``{}``: one point, no
    hyperparameters.
    """
    if grid is None:
        return [{}]
    if isinstance(grid, Mapping):
        names: list[str] = []
        columns: list[list[Value]] = []
        for name, values in grid.items():
            names.append(_check_name(name, "grid"))
            listed = (
                list(values)
                if isinstance(values, Sequence) and not isinstance(values, str)
                else [values]
            )
            if not listed:
                raise MisconfigurationError(
                    f"grid {name}=[] has no value. Give at least one value, or leave {name} "
                    "out of the grid."
                )
            for value in listed:
                _check_value(name, value)
            seen: list[Value] = []
            for value in listed:
                if value in seen:
                    raise MisconfigurationError(
                        f"grid {name}={listed!r} lists {value!r} twice, which would submit the "
                        "same job twice. List each value once."
                    )
                seen.append(value)
            columns.append(listed)
        return [
            dict(zip(names, combination, strict=True))
            for combination in itertools.product(*columns)
        ]
    points: list[dict[str, Value]] = []
    for point in grid:
        if not isinstance(point, Mapping):
            raise MisconfigurationError(
                f"grid point {point!r} is not a mapping. Pass a mapping of lists "
                "({'lr': [1e-3, 1e-2]}) or a list of mappings ([{'lr': 1e-3}, ...])."
            )
        for name, value in point.items():
            _check_name(name, "grid")
            _check_value(name, value)
        points.append(dict(point))
    if not points:
        raise MisconfigurationError("grid=[] has no point. Pass at least one, or grid=None.")
    return points


def _check_value(name: str, value: object) -> None:
    if not isinstance(value, (bool, int, float, str)):
        raise MisconfigurationError(
            f"grid {name}={value!r} is a {type(value).__name__}: hyperparameters are recorded "
            "in hparams.json and passed to scripts as --NAME=VALUE, so they must be numbers, "
            "strings or booleans."
        )


def _slug(value: Value) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]", "_", str(value))[:40]


def _point_folder_name(index: int, hparams: Mapping[str, Value]) -> str:
    parts = [f"{index:03d}", *(f"{name}={_slug(value)}" for name, value in hparams.items())]
    return "-".join(parts)[:120]


def _describe(hparams: Mapping[str, Value]) -> str:
    return " ".join(f"{name}={value}" for name, value in hparams.items()) or "(no hyperparameters)"


# -- the job description ------------------------------------------------------------------


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
class SlurmJob:
    """What one job of a grid asks SLURM for, and the Trainer flags it trains with.

    The seed's ``SlurmCluster`` as a description: ``nodes`` and ``gpus_per_node`` per
    experiment, ``modules`` to load, ``setup`` commands (``export NCCL_DEBUG=INFO``), the
    ``job_name`` squeue shows. ``--ntasks-per-node`` is not set here: it is the number of
    processes per node the selection rules pick for ``trainer`` (the Trainer flags), on a
    node with ``gpus_per_node`` GPUs.

    Attributes:
        nodes: nodes per job (``--nodes``); the Trainer's ``num_nodes``.
        gpus_per_node: GPUs per node (``--gpus-per-node``); the Trainer's ``gpus`` when that
            is not set. 0: a CPU job.
        time: the time limit: minutes, or a SLURM time such as ``"02:00:00"``.
        partition: ``--partition``; None: the cluster's default.
        job_name: what squeue shows (not ``bash`` or ``interactive``: cardcage would take
            the job for an interactive shell).
        modules: ``module load`` lines, in order.
        setup: shell lines run before the training starts (after the modules).
        env: variables exported to the job.
        master_port: the rendezvous port; None: 15000 + the last four digits of the job id
            (distinct for jobs that run at the same time).
        cpus_per_task, mem: ``--cpus-per-task``, ``--mem`` (e.g. ``"32G"``).
        requeue: checkpoint and requeue before the time limit (``--requeue`` and
            ``--signal=SIG@signal_delay_s``); see docs/slurm.md.
        requeue_signal: the signal that asks for it (cardcage's default: USR1).
        signal_delay_s: seconds before the time limit that the signal comes.
        sbatch: any other sbatch option: ``{"account": "proj", "exclusive": True,
            "gres": "gpu:8"}`` (with ``gres``, ``--gpus-per-node`` is left out).
        srun_args: extra ``srun`` arguments; the default ends the whole step when one task
            fails (the other ranks would wait in a collective until a timeout).
        python: the interpreter command in the job; None: this one (``sys.executable``).
        trainer: the Trainer flags (``num_processes``, ``distributed_backend``,
            ``precision``, ``max_epochs``, ...). The job's function gets them from
            :func:`current_run` (``run.trainer()`` builds the Trainer).
    """

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

    def dry_run(
        self,
        target: str | Callable[..., Any],
        grid: Mapping[str, Sequence[Value] | Value] | Sequence[Mapping[str, Value]] | None = None,
        *,
        folder: str | os.PathLike[str] | None = None,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[PlannedJob]:
        """The jobs :meth:`submit` would submit, with their exact sbatch scripts; submits none."""
        return dry_run(target, self, grid, folder=folder, args=args, kwargs=kwargs)

    def submit(
        self,
        target: str | Callable[..., Any],
        grid: Mapping[str, Sequence[Value] | Value] | Sequence[Mapping[str, Value]] | None = None,
        *,
        folder: str | os.PathLike[str] | None = None,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Grid:
        """Submit one job per grid point; see :func:`submit`."""
        return submit(target, self, grid, folder=folder, args=args, kwargs=kwargs)


@dataclass(frozen=True)
class Plan:
    """A validated :class:`SlurmJob`: the layout the selection rules chose, and submitit's
    parameters (without the per-point setup lines)."""

    job: SlurmJob
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


_PLAN_LOCK = threading.Lock()


@contextlib.contextmanager
def _gpus_on_a_node(count: int) -> Iterator[None]:
    """Selection as a compute node with ``count`` GPUs sees it (the login node may have none)."""
    from cardcage import devices

    with _PLAN_LOCK:
        original = devices.cuda_device_count
        setattr(devices, "cuda_device_count", lambda: count)  # noqa: B010 - mypy: a function
        try:
            yield
        finally:
            setattr(devices, "cuda_device_count", original)  # noqa: B010


def _planning_env(job: SlurmJob) -> dict[str, str]:
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


def _trainer_flags(job: SlurmJob) -> tuple[dict[str, Any], int]:
    """The Trainer flags of the job, and the GPUs per node to ask SLURM for."""
    from cardcage.flags import FLAG_NAMES

    if not isinstance(job.trainer, Mapping):
        raise MisconfigurationError(
            f"trainer={job.trainer!r} is not valid: pass the Trainer flags as a mapping, e.g. "
            "trainer={'num_processes': 2, 'max_epochs': 3}."
        )
    flags = dict(job.trainer)
    unknown = [name for name in flags if name not in FLAG_NAMES]
    if unknown:
        from cardcage.flags import did_you_mean

        raise MisconfigurationError(
            f"trainer={{{unknown[0]!r}: ...}}: {unknown[0]!r} is not a Trainer flag."
            f"{did_you_mean(unknown[0], FLAG_NAMES)} Known flags: {', '.join(FLAG_NAMES)}."
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


def _plan(job: SlurmJob) -> Plan:
    from cardcage.selection import select

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
    with _gpus_on_a_node(gpus_per_node):
        launching = select(env=base, **flags)
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
        in_job: Selection = select(env=inside, **flags)
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
    normalized = SlurmJob(
        **{
            **{f.name: getattr(job, f.name) for f in fields(SlurmJob)},
            "modules": modules,
            "setup": setup,
            "srun_args": srun_args,
            "gpus_per_node": gpus_per_node,
        }
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


# -- what a job runs ----------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """What each job runs: a callable, ``module:function``, ``file.py:function`` or a script."""

    kind: str  # callable | import | file | script
    spec: str
    function: Callable[..., Any] | None = None
    path_entry: str | None = None  # sys.path entry for an import target (the submit folder)

    @classmethod
    def of(cls, target: str | os.PathLike[str] | Callable[..., Any]) -> Target:
        if callable(target):
            name = getattr(target, "__qualname__", None) or repr(target)
            module = getattr(target, "__module__", None)
            return cls("callable", f"{module}:{name}" if module else name, target)
        if not isinstance(target, (str, os.PathLike)):
            raise MisconfigurationError(
                f"target={target!r} is not valid: give a function, 'module:function', "
                "'path/to/file.py:function' or 'path/to/script.py'."
            )
        text = os.fspath(target)
        location, colon, attribute = text.rpartition(":")
        if colon and location and attribute.isidentifier():
            if location.endswith(".py"):
                path = Path(location).expanduser().resolve()
                if not path.is_file():
                    raise MisconfigurationError(
                        f"target={text!r}: {location} is not a file. Give the path of the "
                        "Python file that defines the function."
                    )
                return cls("file", f"{path}:{attribute}")
            cwd = os.getcwd()
            added = cwd not in sys.path
            if added:
                sys.path.insert(0, cwd)
            try:
                module = importlib.import_module(location)
            except ImportError as error:
                raise MisconfigurationError(
                    f"target={text!r}: module {location!r} cannot be imported here ({error}). "
                    "Run from the folder that holds it, or give 'path/to/file.py:function'."
                ) from None
            finally:
                if added:
                    sys.path.remove(cwd)
            if not callable(getattr(module, attribute, None)):
                raise MisconfigurationError(
                    f"target={text!r}: module {location!r} has no function {attribute!r}."
                )
            return cls("import", text, path_entry=cwd)
        path = Path(text).expanduser().resolve()
        if text.endswith(".py") and path.is_file():
            return cls("script", str(path))
        raise MisconfigurationError(
            f"target={text!r} is neither a Python script (an existing .py file) nor "
            "'module:function' / 'path/to/file.py:function'."
        )

    def load(self) -> Callable[..., Any]:
        """The function (inside the job)."""
        if self.function is not None:
            return self.function
        location, _, attribute = self.spec.rpartition(":")
        if self.kind == "file":
            namespace = runpy.run_path(location, run_name="cardcage_submitted")
            function = namespace[attribute]
        else:
            if self.path_entry and self.path_entry not in sys.path:
                sys.path.insert(0, self.path_entry)
            function = getattr(importlib.import_module(location), attribute)
        if not callable(function):
            raise TypeError(f"{self.spec} is not callable")
        return function  # type: ignore[no-any-return]


@dataclass(frozen=True)
class GridPoint:
    """One job of a grid, as pickled into the job (everything it needs to run)."""

    index: int
    count: int
    hparams: dict[str, Value]
    folder: str
    target: Target
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    requeue_signal: str | None = None

    def record(self, plan: Plan, job_id: str | None = None) -> dict[str, Any]:
        return {
            "index": self.index,
            "count": self.count,
            "hparams": self.hparams,
            "folder": self.folder,
            "target": self.target.spec,
            "job_id": job_id,
            "trainer_flags": _json_safe(plan.trainer_flags),
            "accelerator": plan.accelerator,
            "nodes": plan.job.nodes,
            "processes_per_node": plan.processes_per_node,
        }


def _json_safe(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return None


def _write_json(path: Path, data: Any) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(temporary, path)


@dataclass(frozen=True)
class Run:
    """The grid point a job runs (inside the job): see :func:`current_run`."""

    index: int
    count: int
    hparams: dict[str, Value]
    folder: Path
    trainer_flags: dict[str, Any]
    job_id: str | None
    restart: int

    def trainer(self, **overrides: Any) -> Trainer:
        """A :class:`cardcage.Trainer` with the submitted flags, ``default_root_dir`` the
        point's folder (it holds the requeue checkpoint), and ``overrides``."""
        from cardcage.trainer import Trainer

        flags = {**self.trainer_flags, "default_root_dir": str(self.folder), **overrides}
        return Trainer(**flags)


def current_run() -> Run | None:
    """Inside a job submitted by cardcage, its grid point; ``None`` elsewhere."""
    path = os.environ.get(RUN_VARIABLE)
    if not path:
        return None
    data = json.loads(Path(path).read_text())
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    return Run(
        index=int(data["index"]),
        count=int(data["count"]),
        hparams=dict(data["hparams"]),
        folder=Path(data["folder"]),
        trainer_flags=dict(data["trainer_flags"]),
        job_id=os.environ.get("SLURM_JOB_ID") or data.get("job_id"),
        restart=int(restart) if restart.isdigit() else 0,
    )


def _take_signals(requeue_signal: str | None) -> None:
    """Undo submitit's signal handlers, so that cardcage's requeue handler alone acts.

    submitit ignores SIGTERM and requeues on its own signal (``USR2``); cardcage's handler
    is installed when ``fit`` starts, for ``requeue_signal``. SIGTERM ends the process again
    (``scancel`` stops every rank at once, as in a plain sbatch job); the requeue signal has
    its default action until ``fit`` installs the handler; submitit's signal, when it is
    not the requeue signal, is ignored (sbatch sends it only without requeue).
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    theirs = parse_signal(os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), "submitit")
    ours = parse_signal(requeue_signal) if requeue_signal else None
    if ours is not None:
        signal.signal(ours, signal.SIG_DFL)
    if theirs is not None and theirs != ours:
        signal.signal(theirs, signal.SIG_IGN)


def _run_point(point: GridPoint) -> Any:
    """Run one grid point in one task of its job (called by submitit in every task)."""
    from cardcage.requeue import REQUEUED_EXIT_STATUS

    _take_signals(point.requeue_signal)
    os.environ[RUN_VARIABLE] = str(Path(point.folder) / POINT_FILE)
    target = point.target
    try:
        if target.kind == "script":
            value = _run_script(target.spec, [*map(str, point.args), *_script_options(point)])
        else:
            function = target.load()
            value = function(*point.args, **point.kwargs, **point.hparams)
    except SystemExit as exit_:
        if exit_.code == REQUEUED_EXIT_STATUS:
            raise  # requeued: no result; the job runs again
        if exit_.code not in (None, 0):
            raise RuntimeError(f"{target.spec} exited with status {exit_.code}") from None
        value = None
    if os.environ.get("SLURM_PROCID", "0") == "0":
        record: dict[str, Any] = {
            "index": point.index,
            "hparams": point.hparams,
            "job_id": os.environ.get("SLURM_JOB_ID"),
            "restarts": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        }
        safe = _json_safe(value)
        if safe is not None or value is None:
            record["result"] = safe
        else:
            record["result_type"] = type(value).__name__
            record["note"] = "not JSON: read it with Grid.results() (submitit's result pickle)"
        _write_json(Path(point.folder) / RESULT_FILE, record)
    return value


def _script_options(point: GridPoint) -> list[str]:
    return [f"--{name}={value}" for name, value in point.hparams.items()]


def _run_script(path: str, argv: list[str]) -> Any:
    """Run ``path`` as ``__main__`` in this process, as ``python path argv...`` would."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [path, *argv]
    sys.path.insert(0, str(Path(path).parent))
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return None


# -- planning and submitting --------------------------------------------------------------


@dataclass(frozen=True)
class PlannedJob:
    """One job of a grid before submission: its folder and exact sbatch script."""

    index: int
    hparams: dict[str, Value]
    folder: Path
    script: str
    parameters: dict[str, Any]
    point: GridPoint = field(repr=False)


def _submitit() -> Any:
    try:
        import submitit
    except ImportError:
        raise MisconfigurationError(
            "submitting to SLURM needs submitit, which is not installed. Install it with "
            f"`pip install 'cardcage[submit]'` (or `pip install '{SUBMITIT_REQUIREMENT}'`)."
        ) from None
    return submitit


def _default_folder(job_name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path.cwd() / "cardcage-jobs" / f"{job_name}-{stamp}"
    folder, number = base, 1
    while folder.exists():
        number += 1
        folder = base.with_name(f"{base.name}-{number}")
    return folder


def _setup_lines(plan: Plan, point: GridPoint) -> list[str]:
    job = plan.job
    lines = [
        f"# cardcage: job {point.index + 1} of {point.count}: {_describe(point.hparams)}",
        f"# cardcage: {plan.describe()}",
    ]
    if plan.requeue_signal is not None:
        lines.append(f"export {REQUEUE_SIGNAL}={plan.requeue_signal}")
    else:
        lines.append(f"export {REQUEUE_SIGNAL}=none")
    lines.append(f"export CARDCAGE_REQUEUE_DIR={shlex.quote(point.folder)}")
    if job.master_port is not None:
        lines.append(f"export MASTER_PORT={job.master_port}")
    else:
        lines.append("export MASTER_PORT=$((15000 + SLURM_JOB_ID % 10000))")
    lines.extend(f"export {key}={shlex.quote(str(value))}" for key, value in job.env.items())
    lines.extend(f"module load {shlex.quote(module)}" for module in job.modules)
    lines.extend(job.setup)
    return lines


def _python_command(job: SlurmJob) -> str:
    return shlex.quote(sys.executable) if job.python is None else job.python


def _sbatch_script(plan: Plan, point: GridPoint) -> tuple[str, dict[str, Any]]:
    """The script submitit's SlurmExecutor writes for ``point``, and its parameters."""
    _submitit()
    from submitit.slurm.slurm import _make_sbatch_string

    parameters = {**plan.parameters, "setup": _setup_lines(plan, point)}
    folder = Path(point.folder)
    # As SlurmExecutor._submitit_command_str builds it.
    command = " ".join(
        [_python_command(plan.job), "-u -m submitit.core._submit", shlex.quote(str(folder))]
    )
    return _make_sbatch_string(command=command, folder=folder, **parameters), parameters


def _points(
    plan: Plan,
    target: str | Callable[..., Any],
    grid: Mapping[str, Sequence[Value] | Value] | Sequence[Mapping[str, Value]] | None,
    folder: str | os.PathLike[str] | None,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
) -> tuple[Path, list[GridPoint]]:
    resolved = Target.of(target)
    hparams_list = expand_grid(grid)
    extra = dict(kwargs or {})
    if resolved.kind == "script":
        if extra:
            raise MisconfigurationError(
                f"kwargs={extra!r} cannot be passed to a script ({resolved.spec}); pass "
                "command-line arguments with args=[...] (after -- on the command line)."
            )
        if any(not isinstance(arg, (str, int, float)) for arg in args):
            raise MisconfigurationError(
                f"args={list(args)!r}: a script gets command-line arguments, strings or "
                "numbers only."
            )
    clash = sorted(set(extra) & set().union(*(set(p) for p in hparams_list)))
    if clash:
        raise MisconfigurationError(
            f"{clash[0]!r} is both a grid hyperparameter and in kwargs. Keep it in one place."
        )
    root = (
        Path(folder).expanduser().resolve()
        if folder is not None
        else _default_folder(plan.job.job_name)
    )
    if (root / MANIFEST).exists():
        raise MisconfigurationError(
            f"folder={str(root)!r} (--folder) already holds a submitted grid ({MANIFEST}). "
            "Give a new folder, or leave it out for a new one under ./cardcage-jobs."
        )
    if "%" in str(root):
        raise MisconfigurationError(
            f"folder={str(root)!r} (--folder) contains '%', which SLURM and submitit read as "
            "a pattern (%j: the job id). Choose a folder without it."
        )
    points = [
        GridPoint(
            index=index,
            count=len(hparams_list),
            hparams=hparams,
            folder=str(root / _point_folder_name(index, hparams)),
            target=resolved,
            args=tuple(args),
            kwargs=extra,
            requeue_signal=plan.requeue_signal,
        )
        for index, hparams in enumerate(hparams_list)
    ]
    return root, points


def dry_run(
    target: str | Callable[..., Any],
    job: SlurmJob | None = None,
    grid: Mapping[str, Sequence[Value] | Value] | Sequence[Mapping[str, Value]] | None = None,
    *,
    folder: str | os.PathLike[str] | None = None,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
) -> list[PlannedJob]:
    """The jobs :func:`submit` would submit, each with its exact sbatch script; submits none,
    writes nothing."""
    plan = (job or SlurmJob()).plan()
    _root, points = _points(plan, target, grid, folder, args, kwargs)
    planned = []
    for point in points:
        script, parameters = _sbatch_script(plan, point)
        planned.append(
            PlannedJob(point.index, point.hparams, Path(point.folder), script, parameters, point)
        )
    return planned


def submit(
    target: str | Callable[..., Any],
    job: SlurmJob | None = None,
    grid: Mapping[str, Sequence[Value] | Value] | Sequence[Mapping[str, Value]] | None = None,
    *,
    folder: str | os.PathLike[str] | None = None,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
) -> Grid:
    """Submit ``target`` once per grid point, each job as ``job`` describes; the :class:`Grid`.

    Args:
        target: what every task of each job runs: a function (called as
            ``target(*args, **kwargs, **hparams)``; rank 0's return value is the job's
            result), ``"module:function"``, ``"path/to/file.py:function"``, or a script
            ``"path/to/train.py"`` (run as ``__main__`` with ``args`` and ``--NAME=VALUE``
            per hyperparameter).
        job: the resources and Trainer flags (default: 1 node, 1 CPU process, 60 minutes).
        grid: ``{"lr": [1e-3, 1e-2], "layers": [16, 32]}``: one job per combination.
        folder: where the grid's folders go (on a file system every node sees); default
            ``./cardcage-jobs/<job_name>-<date>-<time>``.

    Inside the job, :func:`current_run` gives the point (``run.trainer()`` builds the
    Trainer with the submitted flags). Raises :class:`~cardcage.MisconfigurationError` for
    a bad description (nothing is submitted), :class:`SubmissionError` when sbatch fails
    (the jobs submitted until then stay in the manifest).
    """
    plan = (job or SlurmJob()).plan()
    root, points = _points(plan, target, grid, folder, args, kwargs)
    submitit = _submitit()
    if submitit.SlurmExecutor.affinity() < 0:
        raise SubmissionError(
            "cannot submit to SLURM from here: `srun` is not on PATH (not a SLURM login node?). "
            "`cardcage submit --dry-run` prints the scripts without submitting."
        )
    root.mkdir(parents=True, exist_ok=True)
    grid_ = Grid(root, [], _manifest_plan(plan))
    for point in points:
        Path(point.folder).mkdir(parents=True, exist_ok=True)
        _write_json(Path(point.folder) / POINT_FILE, point.record(plan))
        grid_.jobs.append(GridJob(point.index, point.hparams, Path(point.folder), None, plan.tasks))
    grid_.save()
    for point, grid_job in zip(points, grid_.jobs, strict=True):
        executor = submitit.SlurmExecutor(folder=point.folder, python=plan.job.python)
        parameters = {**plan.parameters, "setup": _setup_lines(plan, point)}
        executor.update_parameters(**parameters)
        try:
            submitted = executor.submit(_run_point, point)
        except Exception as error:
            grid_.save()
            raise SubmissionError(
                f"sbatch failed for job {point.index + 1} of {len(points)} "
                f"({_describe(point.hparams)}): {str(error).strip()}"
            ) from None
        grid_job.job_id = str(submitted.job_id)
        _write_json(Path(point.folder) / POINT_FILE, point.record(plan, grid_job.job_id))
        grid_.save()
    return grid_


def _manifest_plan(plan: Plan) -> dict[str, Any]:
    job = plan.job
    return {
        "accelerator": plan.accelerator,
        "rule": plan.rule,
        "nodes": job.nodes,
        "processes_per_node": plan.processes_per_node,
        "gpus_per_node": job.gpus_per_node,
        "job_name": job.job_name,
        "time_min": plan.time_min,
        "requeue_signal": plan.requeue_signal,
        "trainer_flags": _json_safe(plan.trainer_flags),
    }


# -- a submitted grid: status, results, cancellation --------------------------------------


def _slurm(command: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(
            list(command), capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None


def job_states(job_ids: Sequence[str]) -> dict[str, str]:
    """SLURM's state of each job: ``squeue``, then ``scontrol show job`` (finished jobs the
    controller still remembers), then ``sacct`` (accounting, when the cluster has it).
    Jobs none of them knows are left out."""
    wanted = [job_id for job_id in job_ids if job_id]
    states: dict[str, str] = {}
    if not wanted:
        return states
    done = _slurm(["squeue", "-h", "-o", "%i %T", "-j", ",".join(wanted)])
    if done is not None and done.returncode == 0:
        for line in done.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] in wanted:
                states[parts[0]] = parts[1]
    for job_id in wanted:
        if job_id in states:
            continue
        shown = _slurm(["scontrol", "show", "job", "-o", job_id])
        if shown is not None and shown.returncode == 0:
            match = re.search(r"\bJobState=(\S+)", shown.stdout)
            if match:
                states[job_id] = match.group(1)
    missing = [job_id for job_id in wanted if job_id not in states]
    if missing:
        accounted = _slurm(
            ["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(missing)]
        )
        if accounted is not None and accounted.returncode == 0:
            for line in accounted.stdout.splitlines():
                job_id, _, state = line.partition("|")
                if job_id in missing and state:
                    states[job_id] = state.split()[0]
    return states


@dataclass
class GridResult:
    """What one job of a grid produced: ``value`` (rank 0's return value) or ``error``."""

    index: int
    hparams: dict[str, Value]
    job_id: str | None
    state: str
    value: Any = None
    error: str | None = None
    folder: Path | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class GridJob:
    """One submitted job of a grid."""

    index: int
    hparams: dict[str, Value]
    folder: Path
    job_id: str | None
    tasks: int = 1

    def _paths(self, task: int = 0) -> Any:
        from submitit.core.utils import JobPaths

        return JobPaths(self.folder, job_id=self.job_id, task_id=task)

    def log(self, task: int = 0, stream: str = "out") -> Path | None:
        """The path of a task's stdout (``"out"``) or stderr (``"err"``) log."""
        if self.job_id is None:
            return None
        _submitit()
        paths = self._paths(task)
        return Path(paths.stdout if stream == "out" else paths.stderr)

    def outcome(self, task: int = 0) -> tuple[str, Any] | None:
        """submitit's ``("success", value)`` or ``("error", traceback)`` for a task; None
        while there is none."""
        if self.job_id is None:
            return None
        _submitit()
        from submitit.core.utils import pickle_load

        path = Path(self._paths(task).result_pickle)
        if not path.exists():
            return None
        loaded = pickle_load(path)
        return (str(loaded[0]), loaded[1])

    def task_results(self) -> list[Any]:
        """Every task's return value (raises RuntimeError for a task without one)."""
        values = []
        for task in range(self.tasks):
            outcome = self.outcome(task)
            if outcome is None or outcome[0] != "success":
                raise RuntimeError(
                    f"job {self.job_id} task {task} has no result"
                    + (f":\n{outcome[1]}" if outcome else "")
                )
            values.append(outcome[1])
        return values

    def recorded(self) -> dict[str, Any] | None:
        """``result.json`` as rank 0 wrote it, if it did."""
        path = self.folder / RESULT_FILE
        if not path.exists():
            return None
        data: dict[str, Any] = json.loads(path.read_text())
        return data


class Grid:
    """A submitted grid: its jobs, their states and results; ``Grid.load(folder)`` finds it
    again in another process."""

    def __init__(self, root: Path, jobs: list[GridJob], plan: dict[str, Any]):
        self.root = root
        self.jobs = jobs
        self.plan = plan

    def __repr__(self) -> str:
        return f"Grid({str(self.root)!r}, {len(self.jobs)} job(s))"

    @property
    def job_ids(self) -> list[str]:
        return [job.job_id for job in self.jobs if job.job_id]

    def save(self) -> None:
        _write_json(
            self.root / MANIFEST,
            {
                "folder": str(self.root),
                "plan": self.plan,
                "jobs": [
                    {
                        "index": job.index,
                        "hparams": job.hparams,
                        "folder": str(job.folder),
                        "job_id": job.job_id,
                        "tasks": job.tasks,
                    }
                    for job in self.jobs
                ],
            },
        )

    @classmethod
    def load(cls, folder: str | os.PathLike[str]) -> Grid:
        """The grid submitted into ``folder`` (the folder ``submit`` printed)."""
        root = Path(folder).expanduser().resolve()
        manifest = root / MANIFEST
        if not manifest.is_file():
            raise MisconfigurationError(
                f"{str(root)!r} holds no submitted grid (no {MANIFEST}). Pass the folder that "
                "`cardcage submit` printed (or SlurmJob.submit's grid.root)."
            )
        data = json.loads(manifest.read_text())
        jobs = [
            GridJob(
                int(entry["index"]),
                dict(entry["hparams"]),
                Path(entry["folder"]),
                entry.get("job_id"),
                int(entry.get("tasks", 1)),
            )
            for entry in data["jobs"]
        ]
        return cls(root, jobs, dict(data.get("plan", {})))

    def states(self) -> list[str]:
        """Each job's state (``PENDING``, ``RUNNING``, ``COMPLETED``, ``FAILED``, ...).

        A job SLURM no longer knows is ``COMPLETED`` or ``FAILED`` from its result file,
        else ``UNKNOWN``; a job never submitted is ``NOT_SUBMITTED``.
        """
        known = job_states(self.job_ids)
        states = []
        for job in self.jobs:
            if job.job_id is None:
                states.append("NOT_SUBMITTED")
            elif job.job_id in known:
                states.append(known[job.job_id])
            else:
                outcome = job.outcome()
                states.append(
                    "UNKNOWN"
                    if outcome is None
                    else ("COMPLETED" if outcome[0] == "success" else "FAILED")
                )
        return states

    def done(self) -> bool:
        return all(state in TERMINAL_STATES or state == "NOT_SUBMITTED" for state in self.states())

    def wait(self, timeout: float | None = None, poll_s: float = 2.0) -> list[str]:
        """Wait until every job has ended; their final states (TimeoutError at ``timeout``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            states = self.states()
            if all(s in TERMINAL_STATES or s in ("NOT_SUBMITTED", "UNKNOWN") for s in states):
                return states
            if deadline is not None and time.monotonic() > deadline:
                pending = [
                    f"{job.job_id} {state}"
                    for job, state in zip(self.jobs, states, strict=True)
                    if state not in TERMINAL_STATES
                ]
                raise TimeoutError(f"jobs still running after {timeout}s: {', '.join(pending)}")
            time.sleep(poll_s)

    def results(self, *, wait: bool = True, timeout: float | None = None) -> list[GridResult]:
        """Each job's result (rank 0's return value), in grid order; waits for the jobs first
        unless ``wait=False``. A job that failed has ``error`` set, not ``value``."""
        states = self.wait(timeout) if wait else self.states()
        results = []
        for job, state in zip(self.jobs, states, strict=True):
            result = GridResult(job.index, job.hparams, job.job_id, state, folder=job.folder)
            outcome = job.outcome() if job.job_id else None
            if outcome is not None and outcome[0] == "success":
                result.value = outcome[1]
            elif outcome is not None:
                result.error = str(outcome[1])
            else:
                result.error = self._no_result(job, state)
            results.append(result)
        return results

    @staticmethod
    def _no_result(job: GridJob, state: str) -> str:
        if job.job_id is None:
            return "not submitted"
        message = f"job {job.job_id} is {state} and left no result"
        log = job.log(0, "err")
        if log is not None and log.exists():
            tail = log.read_text(errors="replace").splitlines()[-20:]
            message += f"; the end of {log}:\n" + "\n".join(tail)
        return message

    def cancel(self) -> list[str]:
        """``scancel`` every job that has not ended; the ids cancelled."""
        states = self.states()
        live = [
            job.job_id
            for job, state in zip(self.jobs, states, strict=True)
            if job.job_id and state not in TERMINAL_STATES and state != "UNKNOWN"
        ]
        if live:
            done = _slurm(["scancel", *live])
            if done is None or done.returncode != 0:
                said = "" if done is None else (done.stderr or done.stdout).strip()
                raise SubmissionError(f"scancel {' '.join(live)} failed: {said}")
        return live


# -- the command line: `cardcage submit` and `cardcage jobs` ------------------------------


def _submit_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("SLURM job (one per grid point)")
    group.add_argument("--nodes", type=int, default=None, help="nodes per job (num_nodes)")
    group.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node")
    group.add_argument("--time", default=None, help="time limit: minutes or [D-]HH:MM:SS")
    group.add_argument("--partition", default=None)
    group.add_argument("--job-name", default=None, help="what squeue shows (default cardcage)")
    group.add_argument("--module", action="append", default=None, help="module load (repeat)")
    group.add_argument(
        "--setup", action="append", default=None, help="a shell line before training (repeat)"
    )
    group.add_argument("--env", action="append", default=None, help="NAME=VALUE to export")
    group.add_argument("--master-port", type=int, default=None)
    group.add_argument("--cpus-per-task", type=int, default=None)
    group.add_argument("--mem", default=None, help="e.g. 32G")
    group.add_argument(
        "--sbatch",
        action="append",
        default=None,
        metavar="OPTION[=VALUE]",
        help="any other sbatch option, e.g. account=proj or exclusive (repeat)",
    )
    group.add_argument(
        "--no-requeue",
        dest="requeue",
        action="store_false",
        default=None,
        help="no checkpoint-and-requeue before the time limit",
    )
    group.add_argument("--requeue-signal", default=None, help="default USR1")
    group.add_argument("--signal-delay-s", type=int, default=None, help="default 90")
    group.add_argument("--python", default=None, help="interpreter command in the job")
    group = parser.add_argument_group("grid")
    group.add_argument(
        "--grid",
        action="append",
        default=None,
        metavar="NAME=V1,V2",
        help="one hyperparameter's values (repeat: every combination is a job)",
    )
    group.add_argument("--folder", default=None, help="default ./cardcage-jobs/NAME-DATE-TIME")
    group.add_argument(
        "--dry-run", action="store_true", default=None, help="print the sbatch scripts only"
    )
    group.add_argument("--json", action="store_true", default=None, help="print JSON on stdout")


def add_submit_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``cardcage submit`` arguments (options may come before or after the target)."""
    from cardcage.cli import add_trainer_flags

    _submit_options(parser)
    add_trainer_flags(parser)
    parser.add_argument(
        "target", help="train.py (a script), module:function or path/to/file.py:function"
    )
    parser.add_argument(
        "rest", nargs=argparse.REMAINDER, help="more options; after --: the script's arguments"
    )


def _options_parser() -> argparse.ArgumentParser:
    from cardcage.cli import add_trainer_flags

    parser = argparse.ArgumentParser(prog="cardcage submit", add_help=False)
    _submit_options(parser)
    add_trainer_flags(parser)
    return parser


def _pairs(values: Sequence[str] | None, option: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for text in values or ():
        name, equals, value = text.partition("=")
        if not equals or not name.strip():
            raise MisconfigurationError(
                f"{option} {text!r} is not NAME=VALUE. Write it like {option} NCCL_DEBUG=INFO."
            )
        pairs[name.strip()] = value
    return pairs


def job_from_arguments(args: argparse.Namespace) -> SlurmJob:
    """The :class:`SlurmJob` that ``cardcage submit`` arguments describe."""
    from cardcage.cli import trainer_flags
    from cardcage.flags import Flags

    defaults = Flags().as_dict()
    trainer = {
        name: value
        for name, value in trainer_flags(args).items()
        if value is not None and value != defaults.get(name)
    }
    nodes = args.nodes
    if nodes is None:
        nodes = trainer.get("num_nodes", 1)
    extras: dict[str, str | int | bool] = {}
    for text in args.sbatch or ():
        name, equals, value = text.partition("=")
        extras[name.strip()] = value if equals else True
    job = SlurmJob(nodes=nodes, trainer=trainer)
    settings = {
        "gpus_per_node": args.gpus_per_node,
        "time": args.time,
        "partition": args.partition,
        "job_name": args.job_name,
        "modules": args.module,
        "setup": args.setup,
        "master_port": args.master_port,
        "cpus_per_task": args.cpus_per_task,
        "mem": args.mem,
        "requeue": args.requeue,
        "requeue_signal": args.requeue_signal,
        "signal_delay_s": args.signal_delay_s,
        "python": args.python,
    }
    for name, value in settings.items():
        if value is not None:
            setattr(job, name, value)
    job.env = _pairs(args.env, "--env")
    job.sbatch = extras
    return job


def run_submit_command(args: argparse.Namespace) -> int:
    """``cardcage submit``: submit (or with ``--dry-run`` print) one job per grid point."""
    rest = list(args.rest)
    script_args: list[str] = []
    if "--" in rest:
        cut = rest.index("--")
        rest, script_args = rest[:cut], rest[cut + 1 :]
    if rest:
        _options_parser().parse_args(rest, namespace=args)
    grid: dict[str, list[Value]] = {}
    for text in args.grid or ():
        name, values = parse_grid_option(text)
        if name in grid:
            raise MisconfigurationError(
                f"--grid {text!r} repeats {name!r}. Give each hyperparameter once, with all "
                f"its values: --grid {name}=V1,V2."
            )
        grid[name] = values
    job = job_from_arguments(args)
    target = args.target
    if not target.endswith(".py") and script_args:
        raise MisconfigurationError(
            f"arguments after -- ({' '.join(script_args)}) go to a script, but {target!r} is a "
            "function. Make them grid values (--grid NAME=VALUE), or submit a script."
        )
    if args.dry_run:
        planned = dry_run(target, job, grid, folder=args.folder, args=script_args)
        plan = job.plan()
        if args.json:
            document = {
                "plan": _manifest_plan(plan),
                "jobs": [
                    {
                        "index": item.index,
                        "hparams": item.hparams,
                        "folder": str(item.folder),
                        "script": item.script,
                    }
                    for item in planned
                ],
            }
            sys.stdout.write(json.dumps(document, indent=2) + "\n")
            return 0
        print(f"# cardcage submit --dry-run: {len(planned)} job(s), {plan.describe()}")
        for warning in plan.warnings:
            print(f"# warning: {warning}")
        for item in planned:
            print(f"# ---- job {item.index + 1} of {len(planned)}: {_describe(item.hparams)}")
            print(f"# ---- folder {item.folder}")
            sys.stdout.write(item.script if item.script.endswith("\n") else item.script + "\n")
        return 0
    try:
        submitted = submit(target, job, grid, folder=args.folder, args=script_args)
    except SubmissionError as error:
        print(f"cardcage: error: {error}", file=sys.stderr)
        return 1
    if args.json:
        sys.stdout.write(json.dumps(_jobs_document(submitted, None), indent=2) + "\n")
        return 0
    for grid_job in submitted.jobs:
        print(
            f"submitted job {grid_job.job_id}: {_describe(grid_job.hparams)} -> {grid_job.folder}"
        )
    print(f"grid folder: {submitted.root}")
    print(f"status, results and cancel: cardcage jobs {shlex.quote(str(submitted.root))}")
    return 0


def add_jobs_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``cardcage jobs`` arguments."""
    parser.add_argument("folder", help="the grid folder `cardcage submit` printed")
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.add_argument("--cancel", action="store_true", help="scancel the jobs not yet ended")
    parser.add_argument(
        "--wait", action="store_true", help="wait until every job ended (exit 1 unless all ok)"
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds, with --wait")


def _jobs_document(grid: Grid, states: Sequence[str] | None) -> dict[str, Any]:
    jobs = []
    for index, job in enumerate(grid.jobs):
        recorded = job.recorded() or {}
        jobs.append(
            {
                "index": job.index,
                "job_id": job.job_id,
                "state": None if states is None else states[index],
                "hparams": job.hparams,
                "folder": str(job.folder),
                "result": recorded.get("result"),
                "log": None if job.job_id is None else str(job.log(0, "out")),
            }
        )
    return {"folder": str(grid.root), "plan": grid.plan, "jobs": jobs}


def run_jobs_command(args: argparse.Namespace) -> int:
    """``cardcage jobs FOLDER``: the grid's jobs, states and results; ``--cancel``, ``--wait``."""
    grid = Grid.load(args.folder)
    cancelled: list[str] = []
    if args.cancel:
        try:
            cancelled = grid.cancel()
        except SubmissionError as error:
            print(f"cardcage: error: {error}", file=sys.stderr)
            return 1
    if args.wait:
        try:
            states = grid.wait(args.timeout)
        except TimeoutError as error:
            print(f"cardcage: error: {error}", file=sys.stderr)
            return 1
    else:
        states = grid.states()
    document = _jobs_document(grid, states)
    document["cancelled"] = cancelled
    if args.json:
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
    else:
        plan = grid.plan
        print(
            f"grid {grid.root}: {len(grid.jobs)} job(s), {plan.get('accelerator')} on "
            f"{plan.get('nodes')} node(s) x {plan.get('processes_per_node')} process(es)"
        )
        rows = [("index", "job", "state", "hyperparameters", "result")]
        for entry in document["jobs"]:
            result = entry["result"]
            shown = "" if result is None else json.dumps(result)
            rows.append(
                (
                    str(entry["index"]),
                    str(entry["job_id"] or "-"),
                    str(entry["state"]),
                    _describe(entry["hparams"]),
                    shown if len(shown) <= 60 else shown[:57] + "...",
                )
            )
        widths = [max(len(row[column]) for row in rows) for column in range(4)]
        for row in rows:
            cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
            print("  ".join([*cells, row[4]]).rstrip())
        if cancelled:
            print(f"cancelled {len(cancelled)} job(s): {' '.join(cancelled)}")
    if args.wait and any(state != "COMPLETED" for state in states):
        return 1
    return 0
