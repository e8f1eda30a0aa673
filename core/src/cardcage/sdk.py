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
    :func:`env_switch`; :func:`registry` (the plugins loaded for an environment: what
    ``cardcage plugins`` lists), :func:`register_plugin` and :func:`unregister_plugin` (a
    plugin defined in a script or a test, without packaging it).
Each training process
    :class:`Strategy` (the per-process methods every Accelerator has),
    :class:`DistributedAccelerator` (one torch.distributed rank per process),
    :func:`broadcast_from_rank_zero` (every rank starts from rank 0's weights, for a ``wrap``
    that builds no DistributedDataParallel),
    :class:`ShardedAccelerator` (one FSDP2-sharded rank per process: ``fsdp``'s strategy, for
    any launcher), :func:`shard_targets` (the submodules it shards, from ``fsdp_modules``),
    :func:`state_dict_type` (its checkpoint format, ``CARDCAGE_FSDP_STATE_DICT``),
    :class:`StepRunner`, :func:`data_parallel_step`, :func:`convert_batchnorm`,
    :func:`distributed_loader`, :func:`move_to`, :func:`cpu_threads_per_process`,
    :func:`share_cpu_threads`, :func:`gpu_memory_metrics`, :class:`Precision`,
    :class:`Optimization` (``trainer.optimization``: ``wrap`` the optimizers,
    ``scale_learning_rates``), :func:`named_parameters`, :func:`replica_shares` and
    :func:`reduce_replica_outputs` (dp's weighting of replica outputs),
    :class:`TrainerProtocol` (the trainer the Strategy methods take) and
    :class:`ProcessPlace`.
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
    :func:`init_timeout`, :func:`first_recorded`; :class:`Watch` and :data:`HEARTBEAT`
    (the stuck-rank watcher, for a launcher that waits on its workers its own way: Ray's);
    :func:`host_store`, :func:`release_store` and :data:`HOSTED_STORE` (the rendezvous
    store hosted in one process on one address only, which the ranks dial when
    ``CARDCAGE_HOSTED_STORE=1``: a rank that hosts it itself, as Ray's rank 0);
    :class:`Reaper` (a job's own service, a local Ray: every process it starts killed and
    its folder removed when the caller ends, even by SIGKILL) and :func:`make_temp_folder`
    (a private folder with a short path, removed at a later launch once its owner is gone).
Checkpoints
    :func:`save_checkpoint_file` (atomic ``torch.save``; a failed write raises
    ``cardcage.CheckpointError``), :func:`load_checkpoint_file` (``weights_only=True``, checks
    the format; a bad file raises ``MisconfigurationError``), for a backend that overrides
    ``Strategy.save_checkpoint``/``load_checkpoint`` with a format of its own.
Commands and flags (a plugin's own ``cardcage`` commands)
    :class:`Commands` (the registrar the ``cardcage_cli_commands`` hook receives),
    :class:`Command`, :func:`add_trainer_flags` and :func:`trainer_flags` (the Trainer
    flags spelled as every ``cardcage`` command spells them), :data:`FLAG_NAMES` and
    :class:`Flags` (every Trainer flag, validated).
Loggers (a plugin's own ``Trainer(logger="name")``)
    :class:`Logger` (subclass it, set ``logger_name``, return the class from the
    ``cardcage_loggers`` hook).
Cluster jobs (a plugin that submits or requeues jobs)
    :data:`REQUEUE_SIGNAL` and :func:`parse_signal` (the requeue signal setting),
    :data:`INTERACTIVE_SLURM_JOB_NAMES`, :data:`REQUEUED_EXIT_STATUS` (a fit that stopped for
    a requeue exits with it).
Errors
    :class:`MisconfigurationError`, :class:`RankFailedError`.
"""

from __future__ import annotations

from cardcage.backend.accelerator import (
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
from cardcage.backend.distributed import (
    DistributedAccelerator,
    broadcast_from_rank_zero,
    cpu_threads_per_process,
    share_cpu_threads,
)
from cardcage.backend.engines import (
    EngineLoader,
    EngineStrategy,
    broadcast_object,
    environ,
    holds_cpu_tensor,
    take_turns,
)
from cardcage.backend.launch.error_files import ERROR_FILE, first_recorded, write_error_file
from cardcage.backend.launch.launcher import InProcessLauncher, Launcher, ScriptLauncher
from cardcage.backend.launch.reaper import Reaper
from cardcage.backend.launch.rendezvous import HOSTED_STORE, host_store, release_store
from cardcage.backend.launch.tempdirs import make_short as make_temp_folder
from cardcage.backend.launch.watchdog import HEARTBEAT, Watch
from cardcage.backend.launch.workers import (
    SpawnLauncher,
    WorkerLauncher,
    fail,
    leave,
    modules_by_value,
    pickle_job,
    run_started_worker,
    run_worker,
)
from cardcage.backend.selection_types import Selection, SelectionContext
from cardcage.backend.sharded import ShardedAccelerator, shard_targets, state_dict_type
from cardcage.backend.strategy.precision import Precision
from cardcage.backend.strategy.samplers import distributed_loader
from cardcage.backend.strategy.step_runner import (
    StepRunner,
    convert_batchnorm,
    data_parallel_step,
    reduce_replica_outputs,
    replica_shares,
)
from cardcage.backend.strategy.strategy import Strategy, move_to
from cardcage.backend.trainer_protocol import ProcessPlace, TrainerProtocol
from cardcage.checkpoints.io import load as load_checkpoint_file
from cardcage.checkpoints.io import save_atomic as save_checkpoint_file
from cardcage.config.arguments import add_trainer_flags, trainer_flags
from cardcage.config.flags import FLAG_NAMES, Flags
from cardcage.config.model_contract import Optimization, named_parameters
from cardcage.config.variables import REQUEUE_SIGNAL, env_switch, init_timeout, parse_signal
from cardcage.devices import gpu_memory_metrics
from cardcage.environments.base import ClusterEnvironment, env_int
from cardcage.environments.slurm import INTERACTIVE_SLURM_JOB_NAMES
from cardcage.errors import MisconfigurationError, RankFailedError
from cardcage.loggers.base import Logger
from cardcage.plugins.commands import Command, Commands
from cardcage.plugins.manager import Registry, registry
from cardcage.plugins.manager import register as register_plugin
from cardcage.plugins.manager import unregister as unregister_plugin
from cardcage.plugins.spec import hookimpl
from cardcage.train.requeue import REQUEUED_EXIT_STATUS
from cardcage.train.trainer import Trainer

__all__ = [
    "ERROR_FILE",
    "FLAG_NAMES",
    "HEARTBEAT",
    "HOSTED_STORE",
    "INTERACTIVE_SLURM_JOB_NAMES",
    "REQUEUED_EXIT_STATUS",
    "REQUEUE_SIGNAL",
    "Accelerator",
    "Availability",
    "ClusterEnvironment",
    "Command",
    "Commands",
    "DistributedAccelerator",
    "EngineLoader",
    "EngineStrategy",
    "Flags",
    "InProcessLauncher",
    "Launcher",
    "Logger",
    "MisconfigurationError",
    "Optimization",
    "Precision",
    "ProcessPlace",
    "RankFailedError",
    "Reaper",
    "Registry",
    "Resolution",
    "Rule",
    "ScriptLauncher",
    "Selection",
    "SelectionContext",
    "ShardedAccelerator",
    "SpawnLauncher",
    "StepRunner",
    "Strategy",
    "Trainer",
    "TrainerProtocol",
    "Watch",
    "WorkerLauncher",
    "add_trainer_flags",
    "broadcast_from_rank_zero",
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
    "host_store",
    "import_engine",
    "init_timeout",
    "launched_processes_per_node",
    "leave",
    "load_checkpoint_file",
    "make_temp_folder",
    "matching_torch_release",
    "modules_by_value",
    "move_to",
    "named_parameters",
    "parse_signal",
    "pickle_job",
    "reduce_replica_outputs",
    "register_plugin",
    "registry",
    "release_store",
    "replica_shares",
    "run_started_worker",
    "run_worker",
    "save_checkpoint_file",
    "shard_targets",
    "share_cpu_threads",
    "state_dict_type",
    "take_turns",
    "trainer_flags",
    "unregister_plugin",
    "write_error_file",
]
