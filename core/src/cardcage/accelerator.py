"""The Accelerator protocol every backend plugin implements, and the small types around it.

A backend is a subclass of :class:`Accelerator` with a ``name``, optional ``aliases``, the
``rules`` under which it claims a job nobody named a backend for, and an honest
``availability``. The class methods are consulted by the selection engine before anything is
started; an instance is created only for the backend that runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from cardcage.errors import MisconfigurationError

if TYPE_CHECKING:
    from cardcage.selection import Selection, SelectionContext


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


@dataclass
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
    """

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    rules: ClassVar[tuple[Rule, ...]] = ()
    multi_node: ClassVar[bool] = True
    needs_gpus: ClassVar[bool] = False
    cpu_fallback: ClassVar[str] = "cpu"
    uses_tpu_cores: ClassVar[bool] = False

    selection: Selection
    options: dict[str, Any] = field(default_factory=dict)

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
    def names(cls) -> tuple[str, ...]:
        """The canonical name followed by the aliases."""
        return (cls.name, *cls.aliases)


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
