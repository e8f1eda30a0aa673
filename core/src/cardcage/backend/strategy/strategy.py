"""The per-process role of a backend: what runs inside each training process.

:class:`Strategy` holds this process's place in the job (ranks, device, precision) and
everything the core's loop asks of a backend while training: setting the process up
(``setup_process``), adapting data, moving batches, running a step, backward and optimizer
step, the collectives, and the state that leaves the process (``gather_state``,
``save_checkpoint``) or enters it (``load_checkpoint``, ``restore_state``). Every method has a
default that trains in one process on the CPU, so a backend overrides only what differs.

The selection role (class-level: ``name``, ``rules``, ``availability``...) and the
process-creation role (:mod:`cardcage.backend.launch.launcher`) live apart;
:class:`~cardcage.Accelerator` puts the three together.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

from cardcage.backend.strategy.precision import Precision
from cardcage.backend.strategy.samplers import distributed_loader
from cardcage.backend.strategy.step_runner import trained_module
from cardcage.checkpoints import io as checkpoint

if TYPE_CHECKING:
    from cardcage.backend.selection_types import Selection
    from cardcage.backend.trainer_protocol import TrainerProtocol as Trainer

T = TypeVar("T")


class Strategy:
    """What a backend does in each training process. See the module docstring."""

    #: Where the model trains; ``setup_process`` sets it.
    device: torch.device
    #: Whether batches need ``batch_to_device`` (False lets the loop skip the call).
    moves_batches: bool = False
    #: Whether this process runs a loop the user writes (:class:`cardcage.Cage` sets it before
    #: ``setup_environment``): a backend's choices that belong to the Trainer's loop
    #: (horovod multiplying the learning rates) read it.
    own_loop: bool = False
    #: What the Trainer's steps run through: the module :meth:`setup_module` returned for
    #: the Trainer's model when it is not the model itself (a wrapper, a sharded copy).
    parallel: torch.nn.Module | None = None
    #: Whether ranks whose train loaders give different numbers of batches may train
    #: (Horovod's ``hvd.join()`` serves the ranks still training; see ``uneven_source``);
    #: otherwise the loop refuses such loaders before the first step, naming each length.
    joins_uneven_batches: ClassVar[bool] = False

    def __init__(self, selection: Selection):
        self.selection = selection
        self.device = torch.device("cpu")
        self.precision = Precision(selection.flags.precision, "cpu")
        # This process's place; launchers and setup_process set them in each process.
        self.global_rank = selection.global_rank
        self.local_rank = selection.local_rank
        self.world_size = selection.world_size
        #: This process's node (0 on a single machine), from the cluster environment.
        self.node_rank = selection.node_rank

    @property
    def is_global_zero(self) -> bool:
        """Whether this process is rank 0 of the whole job."""
        return self.global_rank == 0

    @property
    def hands_back_results(self) -> bool:
        """Whether this rank hands the trained state back when workers were started for a
        ``fit`` (``ddp_spawn``, horovod, tpu): each node's local rank 0 does, so its
        :meth:`gather_state` must return the full state."""
        return self.local_rank == 0

    @property
    def hand_back_ranks(self) -> list[int]:
        """The global ranks that hand results back: each node's local rank 0, with the same
        number of processes on every node (as the worker launchers start them)."""
        nodes = max(1, self.selection.num_nodes)
        per_node = max(1, self.world_size // nodes)
        return [node * per_node for node in range(nodes)]

    # -- setting up and tearing down this process ----------------------------------------------

    def setup_environment(self) -> None:
        """Join the job: this process's ranks, device, threads and process group (or engine),
        and the precision for ``self.device``.

        Called once in every training process, before any module is set up: by the Trainer's
        :meth:`setup_process`, and by :class:`cardcage.Cage` before the user's function runs.
        The default (one process on the CPU) sets the precision; subclasses join their job
        and set ``self.device`` first, then call ``super().setup_environment()``.
        """
        self.precision = Precision(self.selection.flags.precision, self.device.type)

    def setup_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """Place ``model`` on this backend and return the module that trains it.

        Called after :meth:`setup_environment`, once per module: the Trainer's model, or
        each module a :class:`cardcage.Cage` user sets up. What it returns is ``model``
        itself, a wrapper that runs it (``DistributedDataParallel(StepRunner(model))``, whose
        ``forward(name, ...)`` runs ``model.<name>(...)``), or a module that replaces it (a
        sharded copy). The default casts the model at precision 64; subclasses move it to
        ``self.device`` first (and convert, wrap or shard it), calling
        ``super().setup_module(model)`` for the cast.
        """
        if self.precision.dtype is not None:
            model.to(self.precision.dtype)
            self.moves_batches = True
        return model

    def setup_process(self, trainer: Trainer) -> None:
        """Set up this training process for the Trainer: :meth:`setup_environment`, then
        :meth:`setup_module` of ``trainer.model``.

        Called once in every process that trains, through the ``cardcage_setup_process``
        hook, before ``configure_optimizers``. Afterwards ``trainer.model`` is the module
        that trains (the one a wrapper runs, or the replacement :meth:`setup_module`
        returned) and :attr:`parallel` the wrapper or replacement (``None`` when the model
        trains as it is). A backend overrides the two methods it calls, not this one, so
        that a :class:`cardcage.Cage` sets it up the same way.
        """
        self.setup_environment()
        model = trainer.model
        trained = self.setup_module(model)
        self.parallel = None if trained is model else trained
        trainer.model = trained_module(trained)

    def setup_optimizers(self, trainer: Trainer) -> None:
        """Adapt ``trainer.optimization`` after ``configure_optimizers`` (e.g. wrap them)."""

    def teardown(self, trainer: Trainer) -> None:
        """Release what ``setup_process`` took (process groups, devices).

        Called once in every training process when its training ends, also after a failure,
        through the ``cardcage_teardown_process`` hook.
        """

    # -- data and steps -----------------------------------------------------------------------

    def process_dataloader(self, loader: Any, *, train: bool) -> Any:
        """Adapt a dataloader to this backend.

        The default gives each of several processes its shard (a ``DistributedSampler`` on
        ``world_size``/``global_rank``, keeping the loader's settings) unless
        ``replace_sampler_ddp=False``; one process keeps the loader as it is.
        """
        if self.world_size <= 1 or not self.selection.flags.replace_sampler_ddp:
            return loader
        return distributed_loader(loader, self.world_size, self.global_rank)

    def batch_to_device(self, batch: Any) -> Any:
        """Move (and, at precision 64, cast) a batch; called only when ``moves_batches``."""
        return move_to(batch, self.device, self.precision.dtype)

    def step_function(self, model: torch.nn.Module, name: str) -> Callable[..., Any]:
        """The callable that runs ``model.<name>(batch, batch_idx)`` on this backend.

        The loop calls what this returns once per step; a wrapping backend (DataParallel,
        DistributedDataParallel) returns a function that runs the step inside its wrapper.
        """
        function: Callable[..., Any] = getattr(model, name)
        return function

    def backward(self, loss: torch.Tensor) -> None:
        """Compute gradients (scaled at precision 16); ddp2 also averages them across nodes."""
        self.precision.backward(loss)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step one optimizer (through the grad scaler at precision 16)."""
        self.precision.step(optimizer)

    def skip_gradient_sync(self) -> contextlib.AbstractContextManager[None]:
        """A context in which backward accumulates gradients without communicating.

        With ``accumulate_grad_batches=N > 1`` the loop runs the step and backward of each
        of the first ``N - 1`` micro-batches of an optimizer step inside it; the final
        micro-batch's backward (outside it) synchronizes the accumulated sum as usual. The
        loop divides each micro-batch's loss by ``N``. The default does nothing: a backend
        that synchronizes in backward (DistributedDataParallel's ``no_sync``, FSDP's
        ``set_requires_gradient_sync``) overrides it.
        """
        return contextlib.nullcontext()

    def clip_gradients(
        self, optimizer: torch.optim.Optimizer, value: float, algorithm: str
    ) -> torch.Tensor | None:
        """Clip the gradients of ``optimizer``'s parameters in place.

        Called by the loop for each optimizer when ``gradient_clip_val > 0``: after the
        final micro-batch's backward, ``precision.unscale(optimizers)`` and
        ``on_after_backward``, before :meth:`optimizer_step`, so the gradients are unscaled
        and already synchronized across processes. ``algorithm`` ``"norm"`` scales them so
        that their total 2-norm (over every parameter of ``optimizer``; a sharded backend
        computes it across shards) is at most ``value``; ``"value"`` clamps each element to
        ``[-value, value]``. Parameters without a gradient are left out. Returns the total
        norm before clipping for ``"norm"`` (a Cage user's ``clip_gradients`` returns it),
        else None.
        """
        parameters = [
            p for group in optimizer.param_groups for p in group["params"] if p.grad is not None
        ]
        if not parameters:
            return None
        if algorithm == "norm":
            return torch.nn.utils.clip_grad_norm_(parameters, value)
        if algorithm == "value":
            torch.nn.utils.clip_grad_value_(parameters, value)
            return None
        raise ValueError(f"gradient_clip_algorithm={algorithm!r}: use 'norm' or 'value'")

    def read(self, tensor: torch.Tensor) -> torch.Tensor:
        """A CPU copy of ``tensor``, for the loop to look at a value in the middle of a step
        (``terminate_on_nan`` reads each step's loss before its backward).

        Every rank calls it at the same point. The default is ``tensor.detach().cpu()``; an
        engine whose replicas are threads of one process takes turns at it.
        """
        return tensor.detach().cpu()

    def on_epoch_start(self, epoch: int, loader: Any) -> None:
        """Called before each training epoch: a distributed sampler reshuffles here."""
        sampler = getattr(loader, "sampler", None)
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def on_epoch_end(self, trainer: Trainer) -> None:
        """Called after each training epoch, before validation (GPU backends log memory).
        After it, the loop copies the epoch's losses to the CPU: a lazy engine runs them here."""

    # -- collectives --------------------------------------------------------------------------

    def barrier(self, name: str | None = None) -> None:
        """Wait until every process reaches this point; nothing to wait for in one process."""

    def broadcast(self, obj: T, src: int = 0) -> T:
        """``obj`` as held by rank ``src``; the identity in one process."""
        return obj

    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """``tensor`` reduced over every process (``"mean"`` or ``"sum"``)."""
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's ``tensor`` (the same shape on each), stacked in rank order:
        ``(world_size, *tensor.shape)``. The default places this rank's tensor in zeros and
        sums them with :meth:`reduce`, which every backend has; a backend with a gather of
        its own overrides it."""
        if self.world_size <= 1:
            return tensor.unsqueeze(0)
        gathered = torch.zeros(
            (self.world_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device
        )
        gathered[self.global_rank] = tensor
        return self.reduce(gathered, "sum")

    # -- state that leaves or enters the process ----------------------------------------------

    def unwrapped_model(self, trainer: Trainer) -> torch.nn.Module:
        """The user's module, without any wrapper this backend added."""
        return trainer.model

    def gather_state(self, trainer: Trainer) -> dict[str, Any] | None:
        """The full model and optimizer state: ``{"state_dict": ..., "optimizers": [...]}``.

        Called on every rank at the same point (a checkpoint, a requeue, the results handed
        back from workers), so a sharded backend may run collectives here to gather its
        shards. Ranks that write must get the full state: global rank 0
        (:attr:`is_global_zero`) for checkpoints, and, when workers hand their results back,
        each node's local rank 0 (:attr:`hands_back_results`; their global ranks are
        :attr:`hand_back_ranks`). Other ranks may return ``None``.
        The default costs nothing: every rank holds the full state already.
        """
        return {
            "state_dict": self.unwrapped_model(trainer).state_dict(),
            "optimizers": [o.state_dict() for o in trainer.optimization.optimizers],
        }

    def restore_state(self, trainer: Trainer, state: dict[str, Any]) -> None:
        """Load a full checkpoint's model and optimizer state into this rank.

        Called on every rank after ``setup_process`` and ``configure_optimizers``; a sharded
        backend loads each rank's part here. ``state`` holds ``"state_dict"`` and
        ``"optimizers"`` as :meth:`gather_state` returned them.
        """
        self.unwrapped_model(trainer).load_state_dict(state["state_dict"])
        optimizers = trainer.optimization.optimizers
        for optimizer, saved in zip(optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(saved)

    def save_checkpoint(self, trainer: Trainer, path: str | os.PathLike[str]) -> None:
        """Write ``trainer``'s checkpoint to ``path``; called on every rank at the same point.

        The default gathers the state (``trainer.checkpoint_state()``, which calls
        :meth:`gather_state`), global rank 0 writes it as one file, atomically, and every
        rank waits for the file. A backend with its own format (a folder of shards, one per
        rank) overrides this and :meth:`load_checkpoint`; ``trainer.loop_state()`` is what
        the file holds besides the model and the optimizers.
        """
        state = trainer.checkpoint_state()
        if self.is_global_zero:
            if state is None:
                raise RuntimeError(
                    f"{type(self).__name__}.gather_state returned None on rank 0, which "
                    "writes the checkpoint: return the full state there"
                )
            checkpoint.save_atomic(state, path)
        self.barrier("save_checkpoint")

    def load_checkpoint(self, trainer: Trainer, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Read the checkpoint at ``path`` on this rank, for :meth:`restore_state`.

        Called on every rank after ``setup_process`` and ``configure_optimizers`` (so a
        sharded format can load into the live shards). The default reads one file written
        by :meth:`save_checkpoint` with ``torch.load(weights_only=True)``.
        """
        return checkpoint.load(path)

    def portable(self, obj: T) -> T:
        """``obj`` (a checkpoint, a worker's results) as ``torch.save`` should write it.

        The default returns it unchanged; a backend whose tensors cannot be saved as they are
        (XLA's) moves them to the CPU here.
        """
        return obj


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
