"""The plugin SDK: everything a backend plugin imports from cardcage, in one module.

A plugin imports from here and nowhere else in cardcage, so that what it relies on is
documented, typed and kept stable (the shipped plugins do the same; a test checks that no
plugin imports a private name). Grouped by role:

Registration and selection
    :data:`hookimpl`, :class:`Accelerator`, :class:`Rule`, :class:`Availability`,
    :class:`Resolution`, :class:`SelectionContext`, :class:`Selection`,
    :func:`cuda_availability`, :func:`distributed_availability`,
    :class:`ClusterEnvironment`, :func:`env_int`.
Each training process
    :class:`Strategy` (the per-process methods every Accelerator has),
    :class:`DistributedAccelerator` (one torch.distributed rank per process),
    :class:`StepRunner`, :func:`data_parallel_step`, :func:`distributed_loader`,
    :func:`move_to`, :func:`cpu_threads_per_process`, :func:`gpu_memory_metrics`,
    :class:`Precision`.
Process creation
    :class:`Launcher`, :class:`InProcessLauncher`, :class:`ScriptLauncher`,
    :class:`WorkerLauncher` (pickled trainer, results handed back; a subclass says how N
    workers start), :class:`SpawnLauncher`, :func:`run_worker`, :func:`leave`,
    :func:`fail`, :func:`pickle_job`, :func:`init_timeout`, :func:`first_recorded`.
Errors
    :class:`MisconfigurationError`, :class:`RankFailedError`.
"""

from __future__ import annotations

from cardcage.accelerator import (
    Accelerator,
    Availability,
    Resolution,
    Rule,
    cuda_availability,
    distributed_availability,
)
from cardcage.devices import gpu_memory_metrics
from cardcage.distributed import DistributedAccelerator, cpu_threads_per_process
from cardcage.environments import ClusterEnvironment, env_int
from cardcage.errors import MisconfigurationError, RankFailedError
from cardcage.failures import ERROR_FILE, first_recorded, write_error_file
from cardcage.launchers import InProcessLauncher, Launcher, ScriptLauncher
from cardcage.precision import Precision
from cardcage.rendezvous import init_timeout
from cardcage.samplers import distributed_loader
from cardcage.selection import Selection, SelectionContext
from cardcage.spec import hookimpl
from cardcage.strategy import Strategy, move_to
from cardcage.trainer import Trainer
from cardcage.workers import SpawnLauncher, WorkerLauncher, fail, leave, pickle_job, run_worker
from cardcage.wrappers import StepRunner, data_parallel_step, reduce_replica_outputs

__all__ = [
    "ERROR_FILE",
    "Accelerator",
    "Availability",
    "ClusterEnvironment",
    "DistributedAccelerator",
    "InProcessLauncher",
    "Launcher",
    "MisconfigurationError",
    "Precision",
    "RankFailedError",
    "Resolution",
    "Rule",
    "ScriptLauncher",
    "Selection",
    "SelectionContext",
    "SpawnLauncher",
    "StepRunner",
    "Strategy",
    "Trainer",
    "WorkerLauncher",
    "cpu_threads_per_process",
    "cuda_availability",
    "data_parallel_step",
    "distributed_availability",
    "distributed_loader",
    "env_int",
    "fail",
    "first_recorded",
    "gpu_memory_metrics",
    "hookimpl",
    "init_timeout",
    "leave",
    "move_to",
    "pickle_job",
    "reduce_replica_outputs",
    "run_worker",
    "write_error_file",
]
