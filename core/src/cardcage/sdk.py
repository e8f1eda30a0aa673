"""The plugin SDK: everything a backend plugin imports from cardcage, in one module.

A plugin imports from here and nowhere else in cardcage, so that what it relies on is
documented, typed and kept stable (the shipped plugins do the same; a test checks that no
plugin imports a private name). Grouped by role:

Registration and selection
    :data:`hookimpl`, :class:`Accelerator`, :class:`Rule`, :class:`Availability`,
    :class:`Resolution`, :class:`SelectionContext`, :class:`Selection`,
    :func:`cuda_availability`, :func:`distributed_availability`, :func:`import_engine`,
    :func:`launched_processes_per_node`, :func:`matching_torch_release`,
    :class:`ClusterEnvironment`, :func:`env_int`,
    :func:`env_switch`.
Each training process
    :class:`Strategy` (the per-process methods every Accelerator has),
    :class:`DistributedAccelerator` (one torch.distributed rank per process),
    :class:`StepRunner`, :func:`data_parallel_step`, :func:`convert_batchnorm`,
    :func:`distributed_loader`, :func:`move_to`, :func:`cpu_threads_per_process`,
    :func:`share_cpu_threads`, :func:`gpu_memory_metrics`, :class:`Precision`,
    :class:`Optimization` (``trainer.optimization``: ``wrap`` the optimizers,
    ``scale_learning_rates``), :func:`named_parameters`.
An engine other than torch.distributed (torch-xla, a vendor runtime)
    :class:`EngineStrategy` (the per-process methods, from the engine's primitives), and
    its parts: :func:`environ` (the engine's settings in ``os.environ`` for a while),
    :class:`EngineLoader`, :func:`holds_cpu_tensor`, :func:`broadcast_object`,
    :func:`take_turns`.
Process creation
    :class:`Launcher`, :class:`InProcessLauncher`, :class:`ScriptLauncher`,
    :class:`WorkerLauncher` (pickled trainer, results handed back; a subclass says how N
    workers start), :class:`SpawnLauncher`, :func:`run_worker`, :func:`run_started_worker`,
    :func:`leave`, :func:`fail`, :func:`pickle_job`, :func:`modules_by_value`,
    :func:`init_timeout`, :func:`first_recorded`.
Checkpoints
    :func:`save_checkpoint_file` (atomic ``torch.save``; a failed write raises
    ``cardcage.CheckpointError``), :func:`load_checkpoint_file` (``weights_only=True``, checks
    the format; a bad file raises ``MisconfigurationError``), for a backend that overrides
    ``Strategy.save_checkpoint``/``load_checkpoint`` with a format of its own.
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
    import_engine,
    launched_processes_per_node,
    matching_torch_release,
)
from cardcage.checkpoint import load as load_checkpoint_file
from cardcage.checkpoint import save_atomic as save_checkpoint_file
from cardcage.cluster import env_switch
from cardcage.contract import Optimization, named_parameters
from cardcage.devices import gpu_memory_metrics
from cardcage.distributed import (
    DistributedAccelerator,
    cpu_threads_per_process,
    share_cpu_threads,
)
from cardcage.engines import (
    EngineLoader,
    EngineStrategy,
    broadcast_object,
    environ,
    holds_cpu_tensor,
    take_turns,
)
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
from cardcage.workers import (
    SpawnLauncher,
    WorkerLauncher,
    fail,
    leave,
    modules_by_value,
    pickle_job,
    run_started_worker,
    run_worker,
)
from cardcage.wrappers import (
    StepRunner,
    convert_batchnorm,
    data_parallel_step,
    reduce_replica_outputs,
)

__all__ = [
    "ERROR_FILE",
    "Accelerator",
    "Availability",
    "ClusterEnvironment",
    "DistributedAccelerator",
    "EngineLoader",
    "EngineStrategy",
    "InProcessLauncher",
    "Launcher",
    "MisconfigurationError",
    "Optimization",
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
    "broadcast_object",
    "convert_batchnorm",
    "cpu_threads_per_process",
    "cuda_availability",
    "data_parallel_step",
    "distributed_availability",
    "distributed_loader",
    "env_int",
    "env_switch",
    "environ",
    "fail",
    "first_recorded",
    "gpu_memory_metrics",
    "holds_cpu_tensor",
    "hookimpl",
    "import_engine",
    "init_timeout",
    "launched_processes_per_node",
    "leave",
    "load_checkpoint_file",
    "matching_torch_release",
    "modules_by_value",
    "move_to",
    "named_parameters",
    "pickle_job",
    "reduce_replica_outputs",
    "run_started_worker",
    "run_worker",
    "save_checkpoint_file",
    "share_cpu_threads",
    "take_turns",
    "write_error_file",
]
