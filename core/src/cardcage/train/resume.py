"""A fit's resume from a checkpoint, as the Trainer runs it.

In the process that called ``fit``, :func:`check` opens ``resume_from_checkpoint`` once,
before any process starts (a folder only for a backend with a ``load_checkpoint`` of its
own). In each training process, :func:`resume` picks the checkpoint (a restart's, a
requeued job's own, or ``resume_from_checkpoint``) and :func:`restore` loads what the
backend read of it; :func:`position` says where the first epoch continues. The Trainer's
methods call these.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from cardcage.backend.launch import restarts
from cardcage.backend.strategy.strategy import Strategy
from cardcage.checkpoints import io as checkpoint
from cardcage.checkpoints import validation
from cardcage.config.model_contract import configure_optimizers
from cardcage.errors import MisconfigurationError

if TYPE_CHECKING:
    import torch

    from cardcage.backend.trainer_protocol import TrainerProtocol as Trainer
    from cardcage.train.requeue import RequeueHandler


def check(
    trainer: Trainer, strategy: Strategy, model: torch.nn.Module
) -> validation.Checked | None:
    """``resume_from_checkpoint``, opened and checked once in the process that called
    ``fit`` (see :func:`validation.check_resume`)."""
    path = trainer.flags.resume_from_checkpoint
    if path is None:
        return None
    method = strategy.load_checkpoint
    reads_folders = getattr(method, "__func__", None) is not Strategy.load_checkpoint
    # Throw-away optimizers over the model's parameters, to check the saved states against
    # (no step is taken: the model is not touched); each training process makes its own.
    # One that needs a training process to be made is checked there instead, as before.
    optimizers: list[torch.optim.Optimizer] | None
    try:
        optimizers = configure_optimizers(model).optimizers
    except MisconfigurationError:
        raise
    except Exception:
        optimizers = None
    return validation.check_resume(
        path,
        model,
        reads_folders=reads_folders,
        backend=trainer.selection.accelerator,
        optimizers=optimizers,
    )


def resume(
    trainer: Trainer,
    strategy: Strategy,
    handler: RequeueHandler | None,
    checked: validation.Checked | None,
) -> dict[str, Any] | None:
    """Restore this training process from the checkpoint it resumes from, after
    ``configure_optimizers``; return the checkpoint's state (``None``: it resumes from none).

    ``handler``: the requeue handler of a SLURM job, whose own checkpoint it resumes from
    when requeued; ``checked``: what ``fit`` read of ``resume_from_checkpoint``, not read
    again.
    """
    path = restarts.resume_path(trainer, os.environ) or trainer.flags.resume_from_checkpoint
    if handler is not None:  # a requeued job resumes from its own checkpoint
        run = trainer.run
        path = handler.resume_path(path, strategy.global_rank, run.job if run else None)
    if path is None:
        return None
    with checkpoint.reusing(checked):
        state = strategy.load_checkpoint(trainer, path)
        restore(trainer, strategy, state)
    return state


def restore(trainer: Trainer, strategy: Strategy, state: dict[str, Any]) -> None:
    """Load the checkpoint ``state`` into this training process, after
    ``configure_optimizers``: the model and optimizers (through the backend), the
    schedulers, the grad scaler and the loop's counters."""
    optimizers = trainer.optimization.optimizers
    if len(state["optimizers"]) != len(optimizers):
        raise MisconfigurationError(
            f"resume_from_checkpoint={trainer.flags.resume_from_checkpoint!r} holds "
            f"{len(state['optimizers'])} optimizer state(s), but configure_optimizers() "
            f"returned {len(optimizers)}. Resume with the model that wrote it."
        )
    strategy.restore_state(trainer, state)  # on every rank
    for scheduler, saved in zip(trainer.optimization.schedulers, state["schedulers"], strict=False):
        scheduler.load_state_dict(saved)
    strategy.precision.load_state_dict(state["scaler"])
    trainer.load_callback_states(state.get("callbacks"))
    trainer.current_epoch = int(state["epoch"])
    trainer.global_step = int(state["global_step"])
    trainer.batch_idx = int(state["batch_idx"])


def position(
    trainer: Trainer, state: dict[str, Any] | None
) -> tuple[int, dict[str, Any] | None, bool]:
    """What :meth:`cardcage.Trainer.resume_position` returns for the restored ``state``
    (``None``: the run did not resume), with the random state set to draw from there."""
    if state is None:
        return 0, None, False
    skip = int(state["batch_idx"])
    after_fetch = bool(state.get("rng_after_fetch", False))
    if (skip or after_fetch) and state.get("epoch_rng") is not None:
        checkpoint.set_rng_state(state["epoch_rng"])
        trainer.epoch_rng = state["epoch_rng"]
        return skip, state["rng"], after_fetch
    checkpoint.set_rng_state(state["rng"])
    return 0, None, False
