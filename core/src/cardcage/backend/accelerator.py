"""The Accelerator every backend plugin subclasses, and the small types around it.

An :class:`Accelerator` puts a backend's three roles together:

- **selection** (class level, pure): ``name``, ``aliases``, the ``rules`` under which it
  claims a job nobody named a backend for, an honest ``availability``, ``resolve`` and
  ``processes_per_node``; consulted by the selection engine before anything starts;
- **each training process** (the instance's
  :class:`~cardcage.backend.strategy.strategy.Strategy` methods): ``setup_environment``
  (join the job), ``setup_module`` (placement, wrapping), the collectives,
  ``gather_state``/``restore_state``; the Trainer's loop and :class:`cardcage.Cage` both
  drive them;
- **process creation** (``launcher``, a :class:`~cardcage.backend.launch.launcher.Launcher`):
  how the training processes come to exist.

An instance is created only for the backend that runs. ``fit`` calls its ``setup(trainer)``
once and then its ``train(trainer)`` once, in the process that called ``fit``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from cardcage.backend.launch import restarts
from cardcage.backend.launch.launcher import InProcessLauncher, Launcher
from cardcage.backend.strategy.strategy import Strategy, move_to
from cardcage.errors import MisconfigurationError

if TYPE_CHECKING:
    from cardcage.backend.selection_types import Selection, SelectionContext
    from cardcage.backend.trainer_protocol import TrainerProtocol as Trainer

__all__ = [
    "Accelerator",
    "Availability",
    "Resolution",
    "Rule",
    "cuda_availability",
    "distributed_availability",
    "import_engine",
    "launched_processes_per_node",
    "matching_torch_release",
    "move_to",
]

log = logging.getLogger("cardcage")


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run here; truthy when it can.

    ``reason`` says why not (or, when available, anything worth knowing); ``hint`` is the
    command or setting that would make it available.
    """

    available: bool
    reason: str = ""
    hint: str = ""

    def __bool__(self) -> bool:
        return self.available

    def describe(self) -> str:
        """One line: ``available`` or ``unavailable: <reason> (<hint>)``."""
        if self.available:
            return f"available{': ' + self.reason if self.reason else ''}"
        text = f"unavailable: {self.reason or 'no reason given'}"
        return f"{text} ({self.hint})" if self.hint else text


@dataclass(frozen=True)
class Rule:
    """A reason for a backend to claim a job when no backend was named.

    Rules of all backends are evaluated in ascending ``order`` (ties: backend name); the first
    whose ``when(ctx)`` is true and whose backend is available decides. ``why`` is the
    human sentence shown by ``explain()``; ``warning``, when set, is added to the selection's
    warnings if this rule decides.
    """

    order: int
    when: Callable[[SelectionContext], bool]
    why: str
    name: str | None = None
    warning: str | None = None


@dataclass(frozen=True)
class Resolution:
    """What an explicitly named backend turns into for the given flags.

    ``accelerator`` is the backend that will run (itself, or another one it hands the job to,
    such as ``cpu`` when GPUs were not requested); ``gpu_ids`` replaces the parsed GPU ids
    when ``drop_gpus`` is set; ``warning`` is a line for the selection's warnings.
    """

    accelerator: str
    warning: str | None = None
    drop_gpus: bool = False


class Accelerator(Strategy):
    """Base class of every backend. Subclass it, set the class attributes, register it.

    Selection (class attributes and class methods, consulted before anything starts):
        name: canonical backend name (``distributed_backend=name``).
        aliases: other names that select this backend.
        rules: when this backend claims a job that names no backend.
        multi_node: whether ``num_nodes > 1`` makes sense for it; when False, naming it with
            several nodes is a :class:`~cardcage.MisconfigurationError`.
        needs_gpus: when named with no GPU requested, the job trains on ``cpu_fallback``
            instead (with a warning), before any availability check.
        cpu_fallback: the backend that takes over in that case.
        uses_tpu_cores: whether it trains on the cores named by ``tpu_cores``; naming any
            other backend together with ``tpu_cores`` is an error, and naming this one
            without it too. The defaults then read ``tpu_cores`` as Lightning 1.0 did.
        needs_rendezvous: whether its processes meet through ``MASTER_ADDR``/``MASTER_PORT``
            (torch.distributed's env:// rendezvous); in processes a cluster started that
            supplies neither (mpirun without them, say), selecting it is an error.

    Process creation: ``launcher``, the :class:`~cardcage.backend.launch.launcher.Launcher`
    class that ``train`` uses (override :meth:`make_launcher` to choose one per job).

    Each training process: the :class:`~cardcage.backend.strategy.strategy.Strategy` methods,
    whose defaults train in one process on the CPU.
    """

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    rules: ClassVar[tuple[Rule, ...]] = ()
    multi_node: ClassVar[bool] = True
    needs_gpus: ClassVar[bool] = False
    cpu_fallback: ClassVar[str] = "cpu"
    uses_tpu_cores: ClassVar[bool] = False
    needs_rendezvous: ClassVar[bool] = False
    launcher: ClassVar[type[Launcher]] = InProcessLauncher
    #: Whether this process has warned about ranks with uneven batches (:meth:`uneven_source`).
    uneven_warned: bool = False

    # -- selection ------------------------------------------------------------------------------

    @classmethod
    def availability(cls, ctx: SelectionContext) -> Availability:
        """Whether this backend can run for ``ctx``; look before importing heavy modules."""
        return Availability(True)

    @classmethod
    def resolve(cls, ctx: SelectionContext) -> Resolution:
        """Decide what naming this backend explicitly means for ``ctx``.

        The default refuses a ``uses_tpu_cores`` backend without ``tpu_cores`` and several
        nodes for a single-node backend, hands a GPU backend with no GPU requested to
        ``cpu_fallback``, and warns when a launcher that created the processes started another
        number on this node than ``num_processes`` asks for. Override to add redirects of
        your own, and call ``super().resolve(ctx)`` first to keep these.
        """
        requested = ctx.requested_as or cls.name
        if cls.uses_tpu_cores and ctx.tpu_cores is None:
            raise MisconfigurationError(
                f"distributed_backend={requested!r} needs tpu_cores, which is unset. Set "
                "tpu_cores=1 (one core), 8 (all cores), or [k] (core k)."
            )
        if ctx.num_nodes > 1 and not cls.multi_node:
            raise MisconfigurationError(
                f"distributed_backend={requested!r} runs on one node, but num_nodes="
                f"{ctx.num_nodes}. Set distributed_backend='ddp' (or 'ddp2') to train on "
                "several nodes, or num_nodes=1."
            )
        if cls.needs_gpus and not ctx.gpu_ids:
            return Resolution(
                cls.cpu_fallback,
                warning=f"distributed_backend={requested!r} needs GPUs, but gpus="
                f"{ctx.flags.gpus!r} requests none: training on the CPU instead. Set gpus "
                "to use GPUs.",
            )
        return Resolution(cls.name, ignored_num_processes(ctx))

    @classmethod
    def processes_per_node(cls, ctx: SelectionContext) -> int:
        """How many processes this backend runs on each node for ``ctx``.

        The default: for a ``uses_tpu_cores`` backend, ``tpu_cores`` when it is a count (8: a
        process per core), else 1 (``[k]``: core k, in one process); otherwise as many as the
        launcher that created the processes started on this node
        (:func:`launched_processes_per_node`), else one per requested GPU, else
        ``num_processes``.
        """
        if cls.uses_tpu_cores:
            return ctx.tpu_cores if isinstance(ctx.tpu_cores, int) else 1
        launched = launched_processes_per_node(ctx)
        if launched is not None:
            return launched
        return len(ctx.gpu_ids) if ctx.gpu_ids else ctx.num_processes

    @classmethod
    def check_selection(cls, selection: Selection, env: Mapping[str, str]) -> None:
        """Refuse, before anything starts, what this backend cannot train with: the
        precision (:meth:`check_precision`) and the backend's own settings in ``env`` (the
        mapping ``select`` reads: ``os.environ`` for a Trainer).

        ``select`` calls it for the backend it chose, so ``select``, the Trainer and
        ``cardcage explain`` refuse alike. Pure, as selection is: an override reads and
        raises, and starts nothing.
        """
        cls.check_precision(selection)

    @classmethod
    def check_precision(cls, selection: Selection) -> None:
        """Refuse a precision this backend cannot train at, before anything starts.

        The default allows 32, 64 and ``"bf16"`` everywhere and 16 only with GPUs (never on
        TPU cores).
        """
        if selection.flags.precision == 16 and cls.uses_tpu_cores:
            raise MisconfigurationError(
                f"precision=16 (float16 autocast with a grad scaler) needs CUDA GPUs, but "
                f"distributed_backend={selection.accelerator!r} trains on XLA devices. Use "
                "precision='bf16' (bfloat16 autocast, what TPUs compute in), or 32."
            )
        if selection.flags.precision == 16 and not selection.gpu_ids:
            raise MisconfigurationError(
                f"precision=16 (float16 autocast with a grad scaler) needs CUDA GPUs, but "
                f"distributed_backend={selection.accelerator!r} trains on the CPU here. Use "
                "precision='bf16' on the CPU, or set gpus."
            )

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The canonical name followed by the aliases."""
        return (cls.name, *cls.aliases)

    # -- the lifecycle, in the process that called fit ------------------------------------------

    def setup(self, trainer: Trainer) -> None:
        """Prepare the run in the process that called ``fit``, before any process starts.

        Called once per ``fit``, through the ``cardcage_setup`` hook, before ``train``. The
        default does nothing; a backend checks here what it can check before starting
        processes. Work inside each training process belongs in ``setup_environment`` and
        ``setup_module``.
        """

    def train(self, trainer: Trainer) -> Any:
        """Run the training of ``fit``: start the training processes and wait for them.

        Called once per ``fit``, through the ``cardcage_train`` hook, in the process that
        called ``fit``; what it returns is what ``fit`` returns. The default hands the job
        to :meth:`make_launcher`'s launcher, which runs ``trainer.run_fit_loop()`` in each
        training process, and launches again after a rank died while ``max_restarts``
        allows (:mod:`cardcage.backend.launch.restarts`).
        """
        return restarts.launch(self.make_launcher(), trainer)

    def make_launcher(self) -> Launcher:
        """The launcher for this job: ``launcher(self)`` unless a subclass chooses."""
        return self.launcher(self)

    # -- in each training process ---------------------------------------------------------------

    def uneven_source(self, epoch: int, counts: Sequence[int]) -> int | None:
        """The rank every rank continues from after an epoch in which the ranks trained
        different numbers of batches; ``None`` when they trained as many.

        For a backend that lets an epoch of uneven data (a loader sharded by hand,
        ``replace_sampler_ddp=False``) end instead of hang, as Horovod's ``hvd.join()`` does:
        ``counts[r]`` is rank ``r``'s number of batches, the same list on every rank. The
        first rank that trained the most is returned, and the backend gives its weights and
        optimizer state to every rank; rank 0 warns the first time.
        """
        if len(set(counts)) <= 1:
            return None
        source = counts.index(max(counts))
        if self.global_rank == 0 and not self.uneven_warned:
            self.uneven_warned = True
            log.warning(
                "cardcage: the %s ranks trained on uneven numbers of batches in epoch %d (%s); "
                "every rank continues from rank %d's weights and optimizer state",
                self.name,
                epoch,
                ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(counts)),
                source,
            )
        return source


def launched_processes_per_node(ctx: SelectionContext) -> int | None:
    """How many processes the launcher that created them started on this node; ``None``
    when no launcher did (``ctx.cluster`` does not create processes: cardcage starts them).

    The launcher's own count when it gives one (``LOCAL_WORLD_SIZE``, ``HOROVOD_LOCAL_SIZE``,
    ...), else its world size split evenly over ``num_nodes``. For a backend's
    ``processes_per_node``: once the processes exist, the flags no longer decide how many.
    """
    cluster = ctx.cluster
    if not cluster.creates_processes:
        return None
    return cluster.local_world_size() or max(cluster.world_size() // max(ctx.num_nodes, 1), 1)


def ignored_num_processes(ctx: SelectionContext) -> str | None:
    """A warning when ``num_processes`` asks for more than one process per node and the
    launcher that created them started another number here; ``None`` otherwise."""
    if ctx.num_processes <= 1:
        return None
    launched = launched_processes_per_node(ctx)
    if launched is None or launched == ctx.num_processes:
        return None
    return (
        f"num_processes={ctx.num_processes} is ignored: the {ctx.cluster.name} launcher "
        f"started {launched} process(es) on this node. Leave num_processes unset, or set it "
        f"to {launched}."
    )


def import_engine(module: str, hint: str, broken: str = "") -> tuple[Any, Availability]:
    """Import a backend's engine for ``availability``: ``(module, available)``, or
    ``(None, why not)``.

    Looks for the top-level package first (``<package> is not installed``, with ``hint``),
    then imports ``module``; an import failure is the reason, followed by ``broken`` (what
    usually causes it: a build for another torch, say).
    """
    package = module.partition(".")[0]
    if importlib.util.find_spec(package) is None:
        return None, Availability(False, f"{package} is not installed", hint)
    try:
        return importlib.import_module(module), Availability(True)
    except Exception as error:
        reason = f"{package} is installed, but {module} cannot be imported ({error})"
        return None, Availability(False, f"{reason}: {broken}" if broken else reason, hint)


def matching_torch_release(distribution: str, hint: str) -> Availability:
    """Whether the installed ``distribution``, an engine built for one torch release (as
    torch-xla is), has the installed torch's release (major.minor); unavailable, with
    ``hint``, otherwise. Read from the distributions' metadata: nothing is imported."""
    version, torch_version = (importlib.metadata.version(d) for d in (distribution, "torch"))
    release = ".".join(version.split("+")[0].split(".")[:2])
    if release == ".".join(torch_version.split("+")[0].split(".")[:2]):
        return Availability(True, f"{distribution} {version} for torch {torch_version}")
    return Availability(
        False,
        f"{distribution} {version} needs torch {release}.*, but torch {torch_version} is installed",
        hint,
    )


def cuda_availability(ctx: SelectionContext) -> Availability:
    """CUDA judged from ``torch.cuda.is_available()`` and ``device_count()`` alone.

    For GPU backends' ``availability``; it creates no CUDA context.
    """
    if ctx.cuda_available:
        return Availability(True, f"{ctx.device_count} CUDA device(s)")
    return Availability(
        False,
        "CUDA is not available (torch.cuda.is_available() is False)",
        "run on a machine with an NVIDIA GPU and a CUDA build of torch",
    )


def distributed_availability() -> Availability:
    """Whether this torch build has ``torch.distributed``, for process-group backends."""
    import torch.distributed

    if torch.distributed.is_available():
        return Availability(True)
    return Availability(
        False,
        "this torch build has no torch.distributed",
        "install a torch build with distributed support",
    )
