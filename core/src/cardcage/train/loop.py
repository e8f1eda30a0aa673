"""The training loop, the same for every backend.

It does what a hand-written loop does (``for batch in loader``: zero the gradients, run the
step, backward, optimizer step) and nothing per step that a plain loop would not pay for:
no device sync, no collective (on the CPU each loss is read with ``.item()``, which waits
for nothing there). The backend supplies device placement, the step function, backward and
step (through its precision) and the collectives.

Two details keep it bit-equal to a plain loop: each epoch exhausts the loader's iterator
(stopping after ``len(loader)`` batches would draw a different number of random
permutations), and validation runs under ``torch.random.fork_rng`` so that it changes no
random state the next epoch depends on.
"""

from __future__ import annotations

import functools
import math
import operator
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from cardcage.backend.launch import restarts, watchdog
from cardcage.backend.strategy.precision import Precision
from cardcage.backend.strategy.strategy import Strategy
from cardcage.checkpoints.io import rng_state, set_rng_state
from cardcage.config.model_contract import (
    SchedulerConfig,
    batch_size,
    extract_loss,
    metrics_of,
    weighted_sums,
)
from cardcage.errors import MisconfigurationError
from cardcage.train.losses import LOSS_CHUNK, Losses, stop_on_nan

if TYPE_CHECKING:
    from cardcage.config.flags import Flags
    from cardcage.train.trainer import Trainer


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def check_train_dataloader(loader: Any, flags: Flags) -> None:
    """Before any training process starts: a train loader of length 0 is an error when
    ``max_steps`` asks for steps, else a warning that no training step will run."""
    if _length(loader) != 0:
        return
    hint = _empty_hint(loader)
    if flags.max_steps is not None:
        raise MisconfigurationError(
            f"train_dataloader has length 0, but max_steps={flags.max_steps} asks for "
            f"{flags.max_steps} training steps.{hint} Give train_dataloader at least one "
            "batch, or leave max_steps=None."
        )
    warnings.warn(
        f"cardcage: train_dataloader has length 0: no training step will run and fit leaves "
        f"the weights as they are.{hint} Give train_dataloader at least one batch.",
        UserWarning,
        stacklevel=3,
    )


def _empty_hint(loader: Any) -> str:
    """Why a DataLoader is empty, when its settings say so."""
    samples = _length(getattr(loader, "dataset", None))
    batch_size = getattr(loader, "batch_size", None)
    if samples == 0:
        return " Its dataset is empty."
    if getattr(loader, "drop_last", False) and samples and batch_size and samples < batch_size:
        return (
            f" drop_last=True drops its only batch: the dataset holds {samples} sample(s), "
            f"fewer than batch_size={batch_size}; use drop_last=False or a smaller batch_size."
        )
    return ""


def _no_batch(trainer: Trainer, loader: Any, epoch: int) -> None:
    """This rank's train loader yielded no batch in ``epoch``: an error when ``max_steps``
    asks for more steps, else a warning (unless ``fit`` warned already: length 0)."""
    rank = trainer.accelerator
    length = _length(loader)
    said = f"train_dataloader yielded no batch in epoch {epoch}" + (
        f" on rank {rank.global_rank} of {rank.world_size}" if rank.world_size > 1 else ""
    )
    if length is not None:
        said += f" (its length there is {length})"
    fix = (
        "A loader that yields its batches only once (a generator) must be one that can be "
        "iterated every epoch, such as a DataLoader."
        if trainer.global_step  # it yielded batches before
        else f"Give each of the {rank.world_size} processes at least one batch (at least "
        f"{rank.world_size} x batch_size samples, or drop_last=False)."
        if rank.world_size > 1
        else "Give train_dataloader at least one batch."
    )
    if trainer.flags.max_steps is not None:
        raise MisconfigurationError(
            f"{said}, but max_steps={trainer.flags.max_steps} asks for "
            f"{trainer.flags.max_steps - trainer.global_step} more training steps. {fix}"
        )
    if _length(trainer.train_dataloader) != 0:  # else fit warned before training started
        warnings.warn(f"cardcage: {said}: no training step ran. {fix}", UserWarning, stacklevel=2)


def _still() -> None:
    """No watcher (:mod:`cardcage.backend.launch.watchdog`) counts this rank's progress."""


def fit_loop(trainer: Trainer, accelerator: Strategy, heart: watchdog.Heart | None = None) -> None:
    """Train ``trainer.model`` until ``max_epochs`` or ``max_steps``; ``heart``, when a
    watcher counts this rank's progress (attached before the rank's setup)."""
    try:
        _train(trainer, accelerator, heart.beat if heart is not None else None)
    finally:
        if heart is not None:
            heart.finish()


def _step_calls(
    accelerator: Strategy,
) -> tuple[Callable[[torch.Tensor], Any], Callable[[torch.optim.Optimizer], Any], bool]:
    """The backward and optimizer step the loop calls, and whether it calls the precision's
    ``update``. Where neither the backend nor its precision changes them (no grad scaler,
    no override), ``loss.backward()`` and ``optimizer.step()`` themselves: five Python
    calls a step fewer, the plain loop's own."""
    precision = accelerator.precision
    kind, own = type(accelerator), type(precision)
    plain = precision.scaler is None and all(
        getattr(own, name) is getattr(Precision, name) for name in ("backward", "step", "update")
    )
    backward: Callable[[torch.Tensor], Any] = accelerator.backward
    if plain and kind.backward is Strategy.backward:
        backward = operator.methodcaller("backward")
    optimizer_step: Callable[[torch.optim.Optimizer], Any] = accelerator.optimizer_step
    if plain and kind.optimizer_step is Strategy.optimizer_step:
        optimizer_step = operator.methodcaller("step")
    return backward, optimizer_step, not plain


def _train(trainer: Trainer, accelerator: Strategy, beat: Callable[[], None] | None) -> None:
    """:func:`fit_loop`'s work; ``beat``, when a watcher is attached, counts progress for the
    stuck-rank watcher (three beats a step: before the step, after it returned, after the
    optimizer step)."""
    watched = beat is not None
    beat = beat or _still
    model = trainer.model
    optimization = trainer.optimization
    optimizers = optimization.optimizers
    precision = accelerator.precision
    loader = accelerator.process_dataloader(trainer.train_dataloader, train=True)
    val_loaders = [accelerator.process_dataloader(v, train=False) for v in trainer.val_dataloaders]
    step = accelerator.step_function(model, "training_step")
    to_device = accelerator.batch_to_device if accelerator.moves_batches else None
    autocast = precision.autocast
    backward, optimizer_step, updates = _step_calls(accelerator)
    bar = trainer.progress
    max_steps = trainer.flags.max_steps or math.inf
    max_epochs = trainer.flags.max_epochs or (math.inf if trainer.flags.max_steps else 1)
    single = not optimization.per_optimizer_steps
    # schedulers stepped after optimizer steps: none, and the loop does nothing for them
    step_schedulers = optimization.step_configs()
    epoch_schedulers = optimization.epoch_configs()
    after_backward = getattr(model, "on_after_backward", None)
    if not callable(after_backward):
        after_backward = None
    skip, resume_rng, rng_after_fetch = trainer.resume_position()
    every = restarts.steps_between_checkpoints(trainer.flags)
    # NaN or infinite losses: terminate_on_nan checks each step (one sync a step); otherwise
    # each chunk of LOSS_CHUNK losses is checked once, until the first warning.
    stop = (
        functools.partial(stop_on_nan, trainer, accelerator)
        if trainer.flags.terminate_on_nan
        else None
    )
    tracked = Losses(trainer, watch_nan=stop is None, device=accelerator.device)
    keep = tracked.keep
    empty_warned = False

    epoch = trainer.current_epoch
    while epoch < max_epochs and trainer.global_step < max_steps:
        trainer.current_epoch = epoch
        accelerator.on_epoch_start(epoch, loader)
        if not skip:
            trainer.epoch_rng = rng_state()
        model.train()
        # the bar is called every ``bar_due`` steps (progress.py): an integer test a step
        bar_due, unshown = bar.start_epoch(epoch, _length(loader)), 0
        pending = tracked.pending  # close_chunk empties it in place
        trainer.in_epoch = True
        batch_idx = -1  # stays -1 when the loader yields nothing
        for batch_idx, batch in enumerate(loader):
            if tracked.unread:  # the step that closed a chunk has run: read it now
                tracked.read_chunks()
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
            if watched:
                beat()
            if single:
                for optimizer in optimizers:
                    optimizer.zero_grad()
                if autocast is None:
                    output = step(batch, batch_idx)
                else:
                    with autocast():
                        output = step(batch, batch_idx)
                if watched:
                    beat()
                if isinstance(output, torch.Tensor) and output.numel() == 1:
                    loss = output
                else:  # a dict, or a loss of several values (an error)
                    loss = extract_loss(output)
                if stop is not None:
                    stop(loss, batch_idx)
                backward(loss)
                if after_backward is not None:
                    precision.unscale(optimizers)
                    after_backward()
                for optimizer in optimizers:
                    optimizer_step(optimizer)
            else:
                loss = _per_optimizer_step(
                    step, batch, batch_idx, optimizers, accelerator, after_backward, beat, stop
                )
            if watched:
                beat()
            if updates:
                precision.update()
            kept = keep(loss)
            pending.append(kept)
            if len(pending) == LOSS_CHUNK:
                tracked.close_chunk(trainer.global_step, batch_idx)
            trainer.global_step += 1
            trainer.batch_idx = batch_idx + 1
            if step_schedulers:
                step_due(trainer, step_schedulers, trainer.global_step, loss, accelerator)
            unshown += 1
            if unshown >= bar_due:
                bar_due, unshown = bar.step(kept, batch, unshown), 0
            if trainer.global_step >= max_steps:
                break
            if every and trainer.global_step % every == 0:
                restarts.save_step(trainer)
            if trainer.global_step == trainer.stop_at_step:  # a requeue signal (requeue.py)
                trainer.at_stop_step()  # checkpoints and raises Requeued, or returns
        trainer.in_epoch = False
        if unshown:  # the steps since the bar's last call
            bar.step(kept, batch, unshown)
        epoch_done = trainer.global_step < max_steps or trainer.batch_idx == _length(loader)
        tracked.close_chunk(trainer.global_step - 1, trainer.batch_idx - 1)
        if batch_idx < 0 and not empty_warned:
            _no_batch(trainer, loader, epoch)
            empty_warned = True
        accelerator.on_epoch_end(trainer)
        trainer.record_losses(tracked.epoch())
        if epoch_done:
            trainer.current_epoch, trainer.batch_idx = epoch + 1, 0
        metrics = run_validation(trainer, accelerator, val_loaders, beat) if val_loaders else {}
        if epoch_done and epoch_schedulers:  # after validation: a monitor sees this epoch's
            step_due(trainer, epoch_schedulers, epoch + 1)
        bar.end_epoch(metrics)
        epoch += 1


def step_due(
    trainer: Trainer,
    configs: list[SchedulerConfig],
    count: int,
    loss: torch.Tensor | None = None,
    accelerator: Strategy | None = None,
) -> None:
    """Step each scheduler of ``configs`` whose ``frequency`` divides ``count`` (optimizer
    steps, or epochs done); one with a ``monitor`` gets the metric's latest value
    (``trainer.logged_metrics``; ``"loss"`` in a step scheduler: this step's loss, averaged
    over the ranks so that every rank takes the same decision)."""
    for config in configs:
        if count % config.frequency:
            continue
        if config.monitor is None:
            config.scheduler.step()
            continue
        metrics = trainer.logged_metrics
        if loss is not None and accelerator is not None and config.monitor == "loss":
            metrics = {**metrics, "loss": float(accelerator.reduce(loss.detach().float()))}
        value = metrics.get(config.monitor)
        if value is None:
            available = sorted(k for k in metrics if k != "epoch")
            said = (
                f"the scheduler {type(config.scheduler).__name__} monitors "
                f"{config.monitor!r}, which no step or validation has logged; the metrics "
                f"available are {available}."
            )
            if config.strict:
                raise MisconfigurationError(
                    f"{said} Log it, monitor one of those, or set 'strict': False in the "
                    "scheduler dict to skip the step."
                )
            if not config.warned:
                config.warned = True
                warnings.warn(
                    f"cardcage: {said} Its steps are skipped while it is missing ('strict': "
                    "False).",
                    RuntimeWarning,
                    stacklevel=3,
                )
            continue
        config.scheduler.step(value)


def _per_optimizer_step(
    step: Any,
    batch: Any,
    batch_idx: int,
    optimizers: list[torch.optim.Optimizer],
    accelerator: Strategy,
    after_backward: Any = None,
    beat: Callable[[], None] = _still,
    stop: Callable[[torch.Tensor, int], None] | None = None,
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
        beat()
        loss = extract_loss(output)
        if stop is not None:  # terminate_on_nan
            stop(loss, batch_idx)
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
    beat: Callable[[], None] = _still,
) -> dict[str, float]:
    """Run ``step_name`` over ``loaders`` without gradients; return the mean metrics.

    Runs under ``fork_rng`` so that evaluating changes no random state training uses.
    """
    model = trainer.model
    step = accelerator.step_function(model, step_name)
    to_device = accelerator.batch_to_device if accelerator.moves_batches else None
    autocast = accelerator.precision.autocast
    devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    outputs: list[tuple[dict[str, torch.Tensor], int]] = []
    was_training = model.training
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        model.eval()
        for loader in loaders:
            for batch_idx, batch in enumerate(loader):
                beat()
                size = batch_size(batch)
                if to_device is not None:
                    batch = to_device(batch)
                if autocast is None:
                    output = step(batch, batch_idx)
                else:
                    with autocast():
                        output = step(batch, batch_idx)
                outputs.append((metrics_of(output, prefix), size))
    model.train(was_training)
    # A mean weighted by batch size, over every rank: each rank's sums of value x size and
    # of sizes, added up in one collective, then divided.
    sums = weighted_sums(outputs)
    keys = sorted(sums)
    exact = torch.float64 if accelerator.device.type in ("cpu", "cuda") else torch.float32
    local = torch.tensor(
        [part for key in keys for part in sums[key]], dtype=exact, device=accelerator.device
    )
    total = accelerator.reduce(local, op="sum").cpu().tolist() if keys else []
    reduced = {
        key: total[2 * i] / total[2 * i + 1] if total[2 * i + 1] else math.nan
        for i, key in enumerate(keys)
    }
    trainer.logged_metrics.update(reduced)
    return reduced


def run_validation(
    trainer: Trainer, accelerator: Strategy, loaders: list[Any], beat: Callable[[], None] = _still
) -> dict[str, float]:
    if not callable(getattr(trainer.model, "validation_step", None)):
        return {}
    return evaluate(trainer, accelerator, loaders, "validation_step", "val", beat)
