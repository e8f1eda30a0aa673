"""The training loop, the same for every backend.

It does what a hand-written loop does (``for batch in loader``: zero the gradients, run the
step, backward, optimizer step) and nothing per step that a plain loop would not pay for:
no device sync, no collective, no ``.item()``. The backend supplies device placement, the
step function, backward and step (through its precision) and the collectives.

Two details keep it bit-equal to a plain loop: each epoch exhausts the loader's iterator
(stopping after ``len(loader)`` batches would draw a different number of random
permutations), and validation runs under ``torch.random.fork_rng`` so that it changes no
random state the next epoch depends on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from cardcage import restarts
from cardcage.checkpoint import rng_state, set_rng_state
from cardcage.contract import extract_loss, mean_metrics, metrics_of

if TYPE_CHECKING:
    from cardcage.protocol import TrainerProtocol as Trainer
    from cardcage.strategy import Strategy


LOSS_CHUNK = 64


def batch_size_of(batch: Any) -> int:
    """The number of samples in a batch (length of its first tensor), for samples/s."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size_of(batch[0])
    if isinstance(batch, dict) and batch:
        return batch_size_of(next(iter(batch.values())))
    return 1


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def fit_loop(trainer: Trainer, accelerator: Strategy) -> None:
    """Train ``trainer.model`` until ``max_epochs`` or ``max_steps``."""
    model = trainer.model
    optimization = trainer.optimization
    optimizers = optimization.optimizers
    precision = accelerator.precision
    loader = accelerator.process_dataloader(trainer.train_dataloader, train=True)
    val_loaders = [accelerator.process_dataloader(v, train=False) for v in trainer.val_dataloaders]
    step = accelerator.step_function(model, "training_step")
    to_device = accelerator.batch_to_device if accelerator.moves_batches else None
    autocast = precision.autocast
    backward, optimizer_step = accelerator.backward, accelerator.optimizer_step
    bar = trainer.progress
    max_steps = trainer.flags.max_steps or math.inf
    max_epochs = trainer.flags.max_epochs or (math.inf if trainer.flags.max_steps else 1)
    single = not optimization.per_optimizer_steps
    after_backward = getattr(model, "on_after_backward", None)
    if not callable(after_backward):
        after_backward = None
    skip, resume_rng, rng_after_fetch = trainer.resume_position()
    every = restarts.steps_between_checkpoints(trainer.flags)

    epoch = trainer.current_epoch
    while epoch < max_epochs and trainer.global_step < max_steps:
        trainer.current_epoch = epoch
        accelerator.on_epoch_start(epoch, loader)
        if not skip:
            trainer.epoch_rng = rng_state()
        model.train()
        bar.start_epoch(epoch, _length(loader))
        losses: list[torch.Tensor] = []  # stacked into one tensor every LOSS_CHUNK steps
        pending: list[torch.Tensor] = []
        trainer.in_epoch = True
        for batch_idx, batch in enumerate(loader):
            if skip:  # resuming inside an epoch: draw the same batches, train on the rest
                skip -= 1
                if not skip and resume_rng is not None and not rng_after_fetch:
                    set_rng_state(resume_rng)
                    resume_rng = None
                continue
            if resume_rng is not None:  # saved inside training_step, after its batch was drawn
                set_rng_state(resume_rng)
                resume_rng = None
            if to_device is not None:
                batch = to_device(batch)
            if single:
                for optimizer in optimizers:
                    optimizer.zero_grad()
                if autocast is None:
                    output = step(batch, batch_idx)
                else:
                    with autocast():
                        output = step(batch, batch_idx)
                loss = output if isinstance(output, torch.Tensor) else extract_loss(output)
                backward(loss)
                if after_backward is not None:
                    precision.unscale(optimizers)
                    after_backward()
                for optimizer in optimizers:
                    optimizer_step(optimizer)
            else:
                loss = _per_optimizer_step(
                    step, batch, batch_idx, optimizers, accelerator, after_backward
                )
            precision.update()
            pending.append(loss.detach())
            if len(pending) == LOSS_CHUNK:  # thousands of tiny tensors fragment memory
                losses.append(torch.stack(pending))
                pending.clear()
            trainer.global_step += 1
            trainer.batch_idx = batch_idx + 1
            if bar.enabled:
                bar.step(loss, batch_size_of(batch))
            if trainer.global_step >= max_steps:
                break
            if every and trainer.global_step % every == 0:
                restarts.save_step(trainer)
            if trainer.global_step == trainer.stop_at_step:  # a requeue signal (requeue.py)
                trainer.at_stop_step()  # checkpoints and raises Requeued, or returns
        trainer.in_epoch = False
        epoch_done = trainer.global_step < max_steps or trainer.batch_idx == _length(loader)
        if pending:
            losses.append(torch.stack(pending))
        trainer.record_losses(losses)
        accelerator.on_epoch_end(trainer)
        if epoch_done:
            trainer.current_epoch, trainer.batch_idx = epoch + 1, 0
            for scheduler in optimization.schedulers:
                scheduler.step()
        metrics = run_validation(trainer, accelerator, val_loaders) if val_loaders else {}
        bar.end_epoch(metrics)
        epoch += 1


def _per_optimizer_step(
    step: Any,
    batch: Any,
    batch_idx: int,
    optimizers: list[torch.optim.Optimizer],
    accelerator: Strategy,
    after_backward: Any = None,
) -> torch.Tensor:
    """Lightning 1.0's multi-optimizer contract: one step per optimizer, ``optimizer_idx``."""
    precision = accelerator.precision
    loss = torch.zeros(())
    for index, optimizer in enumerate(optimizers):
        optimizer.zero_grad()
        if precision.autocast is None:
            output = step(batch, batch_idx, optimizer_idx=index)
        else:
            with precision.autocast():
                output = step(batch, batch_idx, optimizer_idx=index)
        loss = extract_loss(output)
        accelerator.backward(loss)
        if after_backward is not None:
            precision.unscale([optimizer])
            after_backward()
        accelerator.optimizer_step(optimizer)
    return loss


def evaluate(
    trainer: Trainer,
    accelerator: Strategy,
    loaders: Iterable[Any],
    step_name: str,
    prefix: str,
) -> dict[str, float]:
    """Run ``step_name`` over ``loaders`` without gradients; return the mean metrics.

    Runs under ``fork_rng`` so that evaluating changes no random state training uses.
    """
    model = trainer.model
    step = accelerator.step_function(model, step_name)
    to_device = accelerator.batch_to_device if accelerator.moves_batches else None
    autocast = accelerator.precision.autocast
    devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    outputs: list[dict[str, torch.Tensor]] = []
    was_training = model.training
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        model.eval()
        for loader in loaders:
            for batch_idx, batch in enumerate(loader):
                if to_device is not None:
                    batch = to_device(batch)
                if autocast is None:
                    output = step(batch, batch_idx)
                else:
                    with autocast():
                        output = step(batch, batch_idx)
                outputs.append(metrics_of(output, prefix))
    model.train(was_training)
    metrics = mean_metrics(outputs)
    reduced = {
        key: float(accelerator.reduce(torch.tensor(value, device=accelerator.device)))
        for key, value in metrics.items()
    }
    trainer.logged_metrics.update(reduced)
    return reduced


def run_validation(trainer: Trainer, accelerator: Strategy, loaders: list[Any]) -> dict[str, float]:
    if not callable(getattr(trainer.model, "validation_step", None)):
        return {}
    return evaluate(trainer, accelerator, loaders, "validation_step", "val")
