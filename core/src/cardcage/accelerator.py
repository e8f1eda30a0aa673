"""The Accelerator protocol every backend plugin implements, and the small types around it.

A backend is a subclass of :class:`Accelerator` with a ``name``, optional ``aliases``, the
``rules`` under which it claims a job nobody named a backend for, and an honest
``availability``. The class methods are consulted by the selection engine before anything is
started; an instance is created only for the backend that runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

from cardcage.errors import MisconfigurationError
from cardcage.precision import Precision

if TYPE_CHECKING:
    from cardcage.selection import Selection, SelectionContext
    from cardcage.trainer import Trainer

T = TypeVar("T")


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


class Accelerator:
    """Base class of every backend. Subclass it, set the class attributes, register it.

    Class attributes:
        name: canonical backend name (``distributed_backend=name``).
        aliases: other names that select this backend.
        rules: when this backend claims a job that names no backend.
        multi_node: whether ``num_nodes > 1`` makes sense for it; when False, naming it with
            several nodes is a :class:`~cardcage.MisconfigurationError`.
        needs_gpus: when named with no GPU requested, the job trains on ``cpu_fallback``
            instead (with a warning), before any availability check.
        cpu_fallback: the backend that takes over in that case.
        uses_tpu_cores: whether it trains on the cores named by ``tpu_cores``; naming any
            other backend together with ``tpu_cores`` is an error.
        needs_rendezvous: whether its processes meet through ``MASTER_ADDR``/``MASTER_PORT``
            (torch.distributed's env:// rendezvous); in processes a cluster started that
            supplies neither (mpirun without them, say), selecting it is an error.

    The class methods decide selection. An instance is made for the backend that runs; the
    core's training loop calls its instance methods. The defaults train in this process on
    the CPU, so a backend overrides only what differs: device placement (``setup``,
    ``batch_to_device``), model wrapping (``step_function``), data (``process_dataloader``),
    process creation (``train``) and the collectives (``barrier``, ``broadcast``,
    ``reduce``).
    """

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    rules: ClassVar[tuple[Rule, ...]] = ()
    multi_node: ClassVar[bool] = True
    needs_gpus: ClassVar[bool] = False
    cpu_fallback: ClassVar[str] = "cpu"
    uses_tpu_cores: ClassVar[bool] = False
    needs_rendezvous: ClassVar[bool] = False

    #: Where the model trains; ``setup`` sets it.
    device: torch.device
    #: Whether batches need ``batch_to_device`` (False lets the loop skip the call).
    moves_batches: bool = False

    def __init__(self, selection: Selection):
        self.selection = selection
        self.device = torch.device("cpu")
        self.precision = Precision(selection.flags.precision, "cpu")
        # This process's place; launchers set them in the processes they start.
        self.global_rank = selection.global_rank
        self.local_rank = selection.local_rank
        self.world_size = selection.world_size

    @classmethod
    def availability(cls, ctx: SelectionContext) -> Availability:
        """Whether this backend can run for ``ctx``; look before importing heavy modules."""
        return Availability(True)

    @classmethod
    def resolve(cls, ctx: SelectionContext) -> Resolution:
        """Decide what naming this backend explicitly means for ``ctx``.

        The default refuses several nodes for a single-node backend and hands a GPU backend
        with no GPU requested to ``cpu_fallback``. Override to add redirects of your own, and
        call ``super().resolve(ctx)`` first to keep these.
        """
        requested = ctx.requested_as or cls.name
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
        return Resolution(cls.name)

    @classmethod
    def processes_per_node(cls, ctx: SelectionContext) -> int:
        """How many processes this backend runs on each node for ``ctx``.

        The default is one per requested GPU, else ``num_processes``.
        """
        return len(ctx.gpu_ids) if ctx.gpu_ids else ctx.num_processes

    @classmethod
    def check_precision(cls, selection: Selection) -> None:
        """Refuse a precision this backend cannot train at, before anything starts.

        The default allows 32, 64 and ``"bf16"`` everywhere and 16 only with GPUs.
        """
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

    # -- the instance API, called by the core while training -------------------------------

    @property
    def is_global_zero(self) -> bool:
        """Whether this process is rank 0 of the whole job."""
        return self.global_rank == 0

    def setup(self, trainer: Trainer) -> None:
        """Prepare this process before training: place the model, set the precision.

        Called through the ``cardcage_setup`` hook in the process that trains.
        """
        self.precision = Precision(trainer.flags.precision, self.device.type)
        if self.precision.dtype is not None:
            trainer.model.to(self.precision.dtype)
            self.moves_batches = True

    def train(self, trainer: Trainer) -> Any:
        """Run training; the default runs the core's loop in this process.

        Backends that start processes override this. Called through the ``cardcage_train``
        hook; what it returns is what ``fit`` returns.
        """
        return trainer.run_fit_loop()

    def process_dataloader(self, loader: Any, *, train: bool) -> Any:
        """Adapt a dataloader to this backend (a distributed sampler, a device loader)."""
        return loader

    def batch_to_device(self, batch: Any) -> Any:
        """Move (and, at precision 64, cast) a batch; called only when ``moves_batches``."""
        return move_to(batch, self.device, self.precision.dtype)

    def step_function(self, model: torch.nn.Module, name: str) -> Callable[..., Any]:
        """The callable that runs ``model.<name>(batch, batch_idx)`` on this backend.

        The loop calls what this returns once per step; a wrapping backend (DataParallel)
        returns a function that runs the step inside its replicas.
        """
        function: Callable[..., Any] = getattr(model, name)
        return function

    def backward(self, loss: torch.Tensor) -> None:
        """Compute gradients (scaled at precision 16); ddp2 also averages them across nodes."""
        self.precision.backward(loss)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step one optimizer (through the grad scaler at precision 16)."""
        self.precision.step(optimizer)

    def setup_optimizers(self, trainer: Trainer) -> None:
        """Adapt ``trainer.optimization`` after ``configure_optimizers`` (e.g. wrap them)."""

    def on_epoch_start(self, epoch: int, loader: Any) -> None:
        """Called before each training epoch (distributed samplers reshuffle here)."""

    def on_epoch_end(self, trainer: Trainer) -> None:
        """Called after each training epoch, before validation (GPU backends log memory)."""

    def barrier(self, name: str | None = None) -> None:
        """Wait until every process reaches this point; nothing to wait for in one process."""

    def broadcast(self, obj: T, src: int = 0) -> T:
        """``obj`` as held by rank ``src``; the identity in one process."""
        return obj

    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """``tensor`` reduced over every process (``"mean"`` or ``"sum"``)."""
        return tensor

    def unwrapped_model(self, trainer: Trainer) -> torch.nn.Module:
        """The user's module, without any wrapper this backend added."""
        return trainer.model

    def portable(self, obj: T) -> T:
        """``obj`` (a checkpoint, a worker's results) as ``torch.save`` should write it.

        The default returns it unchanged; a backend whose tensors cannot be saved as they are
        (XLA's) moves them to the CPU here.
        """
        return obj

    def teardown(self, trainer: Trainer) -> None:
        """Release what ``setup`` took (process groups, devices)."""


def move_to(batch: Any, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    """``batch`` with every tensor moved to ``device`` (floating ones cast to ``dtype``)."""
    if isinstance(batch, torch.Tensor):
        if dtype is not None and batch.is_floating_point():
            return batch.to(device=device, dtype=dtype, non_blocking=True)
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        moved = [move_to(item, device, dtype) for item in batch]
        if hasattr(batch, "_fields"):  # a namedtuple
            return type(batch)(*moved)
        return type(batch)(moved)
    if isinstance(batch, dict):
        return type(batch)({k: move_to(v, device, dtype) for k, v in batch.items()})
    return batch


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
