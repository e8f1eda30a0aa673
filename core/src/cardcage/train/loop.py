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

import contextlib
import functools
import inspect
import math
import operator
import warnings
from collections.abc import Callable, Iterable, Iterator
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
from cardcage.train import agreement
from cardcage.train.losses import LOSS_CHUNK, Losses, stop_on_nan
from cardcage.train.metrics import EVAL_BATCH, EVAL_EPOCH, TRAIN_BATCH, TRAIN_EPOCH

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
    accelerator: Strategy, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
) -> tuple[
    Callable[[torch.Tensor], Any],
    Callable[[torch.Tensor, int], Any],
    Callable[[torch.optim.Optimizer], Any],
    bool,
]:
    """The backward the loop calls (and the one a per-optimizer turn calls with its
    optimizer's index), the optimizer step, and whether it calls the precision's ``update``.
    Where neither the backend nor its precision changes them (no grad scaler, no override),
    ``loss.backward()`` and ``optimizer.step()`` themselves: five Python calls a step fewer,
    the plain loop's own. A model's own ``backward(loss, optimizer, optimizer_idx)`` hook
    replaces ``loss.backward()`` where the backend adds nothing to it."""
    precision = accelerator.precision
    kind, own = type(accelerator), type(precision)
    plain = precision.scaler is None and all(
        getattr(own, name) is getattr(Precision, name) for name in ("backward", "step", "update")
    )
    backward: Callable[[torch.Tensor], Any] = accelerator.backward
    if plain and kind.backward is Strategy.backward:
        backward = operator.methodcaller("backward")
    model_backward = getattr(model, "backward", None)
    if callable(model_backward):
        if not (plain and kind.backward is Strategy.backward):
            raise MisconfigurationError(
                f"The model defines the hook backward(loss, optimizer, optimizer_idx), but the "
                f"backend {accelerator.selection.accelerator!r} at precision="
                f"{accelerator.selection.flags.precision!r} runs its own backward (a grad "
                "scaler or a reduction across nodes) that the hook would skip. Remove the "
                "hook, or train with precision=32 on another backend."
            )

        def indexed(loss: torch.Tensor, index: int) -> None:
            model_backward(loss, optimizers[index] if optimizers else None, index)

        def backward(loss: torch.Tensor) -> None:
            indexed(loss, 0)

    else:
        unindexed = backward

        def indexed(loss: torch.Tensor, index: int) -> None:
            unindexed(loss)

    optimizer_step: Callable[[torch.optim.Optimizer], Any] = accelerator.optimizer_step
    if plain and kind.optimizer_step is Strategy.optimizer_step:
        optimizer_step = operator.methodcaller("step")
    return backward, indexed, optimizer_step, not plain


class _Stepping:
    """What a model's ``optimizer_step`` hook gets as its optimizer: the real one, whose
    ``step`` goes through the backend (its precision, its engine)."""

    def __init__(self, optimizer: torch.optim.Optimizer, step: Callable[[Any], Any]):
        self._optimizer = optimizer
        self._step = step

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            closure()
        self._step(self._optimizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


def _model_optimizer_step(
    trainer: Trainer, model: torch.nn.Module, step: Callable[[torch.optim.Optimizer], Any]
) -> Callable[[torch.optim.Optimizer], Any]:
    """``optimizer_step`` through the model's hook of that name, with Lightning 1.0's
    arguments; its ``optimizer.step(closure=...)`` runs the backend's step."""
    hook: Callable[..., Any] = model.optimizer_step  # type: ignore[assignment]
    accelerator = trainer.accelerator
    on_tpu = accelerator.device.type == "xla"
    native_amp = accelerator.precision.scaler is not None
    index = {id(o): i for i, o in enumerate(trainer.optimization.optimizers)}

    def optimizer_step(optimizer: torch.optim.Optimizer) -> None:
        hook(
            trainer.current_epoch,
            trainer.batch_idx,
            _Stepping(optimizer, step),
            index.get(id(optimizer), 0),
            lambda: None,
            on_tpu,
            native_amp,
            isinstance(optimizer, torch.optim.LBFGS),
        )

    return optimizer_step


def batch_limit(value: float | int, length: int | None, flag: str) -> float:
    """How many batches ``limit_*_batches`` lets an epoch run: a count, or a fraction of
    ``length`` (rounded down, at least one batch when the fraction is above 0)."""
    if isinstance(value, float):
        if value >= 1.0:
            return math.inf
        if length is None:
            raise MisconfigurationError(
                f"{flag}={value} is a fraction of the batches, but the loader has no len(). "
                f"Give {flag} a number of batches (an int)."
            )
        return max(int(length * value), 1 if value > 0 else 0)
    return float(value)


def _detached(output: Any) -> Any:
    """A step's output as ``*_epoch_end`` gets it: tensors detached, a loss as ``{"loss"}``
    (each turn's, in the list of a batch stepped once per optimizer)."""
    if isinstance(output, list):
        return [_detached(turn) for turn in output]
    if isinstance(output, torch.Tensor):
        return {"loss": output.detach()}
    if isinstance(output, dict):
        return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in output.items()}
    return output


def write_metrics(trainer: Trainer, metrics: dict[str, float], step: int) -> None:
    """Record ``metrics`` in ``trainer.logged_metrics``; global rank 0 hands them to the
    logger."""
    if not metrics:
        return
    trainer.logged_metrics.update(metrics)
    logger = trainer.logger
    if logger is not None and trainer.is_global_zero:
        logger.log_metrics(dict(metrics), step)


def _agreed_stop(trainer: Trainer, accelerator: Strategy) -> bool:
    """``trainer.should_stop`` as every rank sees it: any rank asking stops them all."""
    asked = bool(trainer.should_stop)
    if accelerator.world_size > 1:
        votes = accelerator.reduce(torch.tensor([float(asked)], device=accelerator.device), "sum")
        asked = bool(float(votes.reshape(-1)[0]) > 0)
    trainer.should_stop = asked
    return asked


def _train(trainer: Trainer, accelerator: Strategy, beat: Callable[[], None] | None) -> None:
    """:func:`fit_loop`'s work; ``beat``, when a watcher is attached, counts progress for the
    stuck-rank watcher (three beats a step: before the step, after it returned, after the
    optimizer step)."""
    watched = beat is not None
    beat = beat or _still
    model = trainer.model
    flags = trainer.flags
    hooks = trainer.hooks
    store = trainer.metrics
    optimization = trainer.optimization
    optimizers = optimization.optimizers
    precision = accelerator.precision
    loader = accelerator.process_dataloader(trainer.train_dataloader, train=True)
    val_loaders = [accelerator.process_dataloader(v, train=False) for v in trainer.val_dataloaders]
    step = accelerator.step_function(model, "training_step")
    to_device = accelerator.batch_to_device if accelerator.moves_batches else None
    autocast = precision.autocast
    backward, indexed_backward, optimizer_step, updates = _step_calls(
        accelerator, model, optimizers
    )
    if callable(getattr(model, "optimizer_step", None)):
        optimizer_step = _model_optimizer_step(trainer, model, optimizer_step)
    bar = trainer.progress
    bar.shown = store.bar_values  # self.log(..., prog_bar=True) values, shown at redraws
    fast = flags.fast_dev_run
    max_steps = flags.max_steps or math.inf
    max_epochs = flags.max_epochs or (math.inf if flags.max_steps else 1)
    if fast:
        max_epochs = 1
    min_epochs = flags.min_epochs or 1
    # optimizer_idx models: each batch is a turn per optimizer (_turns)
    turns = _turns(model, optimizers, optimization.per_optimizer_steps)
    accumulate = flags.accumulate_grad_batches
    skip_sync = accelerator.skip_gradient_sync
    clip = float(flags.gradient_clip_val)
    clip_algorithm = flags.gradient_clip_algorithm
    log_every = flags.log_every_n_steps
    step_values = store.step_values
    # schedulers stepped after optimizer steps: none, and the loop does nothing for them
    step_schedulers = optimization.step_configs()
    epoch_schedulers = optimization.epoch_configs()
    after_backward = hooks.get("on_after_backward")
    before_zero_grad = hooks.get("on_before_zero_grad")
    batch_start_cb = hooks.get("on_batch_start")
    batch_start = hooks.get("on_train_batch_start")
    batch_end_cb = hooks.get("on_batch_end")
    batch_end = hooks.get("on_train_batch_end")
    step_end = getattr(model, "training_step_end", None)
    if not callable(step_end) or getattr(step, "calls_step_end", False):
        step_end = None
    epoch_end = getattr(model, "training_epoch_end", None)
    outputs: list[Any] = []
    collect = callable(epoch_end)
    # a step that runs no hook, no accumulation, no clipping and one turn: the plain loop's
    hooked = any(
        h is not None
        for h in (before_zero_grad, batch_start_cb, batch_start, batch_end_cb, batch_end, step_end)
    )
    hooked = hooked or collect or accumulate > 1 or clip > 0 or turns[0].index is not None
    skip, resume_rng, rng_after_fetch = trainer.resume_position()
    every = restarts.steps_between_checkpoints(flags)
    # NaN or infinite losses: terminate_on_nan checks each step (one sync a step); otherwise
    # each chunk of LOSS_CHUNK losses is checked once, until the first warning.
    stop = functools.partial(stop_on_nan, trainer, accelerator) if flags.terminate_on_nan else None
    tracked = Losses(trainer, watch_nan=stop is None, device=accelerator.device)
    keep = tracked.keep
    empty_warned = False
    length = _length(loader)
    limit = batch_limit(
        fast if fast and fast is not True else 1 if fast else flags.limit_train_batches,
        length,
        "limit_train_batches",
    )
    epoch_length = (
        length if limit == math.inf else min(limit, length if length is not None else math.inf)
    )
    # a loader without len() that accumulates is read one batch ahead, so that the epoch's
    # last batch is known when it trains and its shorter group steps (_Lookahead)
    ahead = _Lookahead(loader) if epoch_length is None and accumulate > 1 else None
    batches = ahead if ahead is not None else loader
    if limit == 0:  # Lightning 1.0: limit_train_batches=0 runs no epoch (nor its hooks)
        max_epochs = 0
    if accelerator.world_size > 1 and not accelerator.joins_uneven_batches:
        # a rank with more batches would wait in its extra steps
        beat()  # here before the exchange: a rank still in its setup is the one named stuck
        agreement.agree_train_batches(
            accelerator, int(epoch_length) if epoch_length is not None else None
        )

    _start(trainer, accelerator, val_loaders, beat)
    epoch = trainer.current_epoch
    while epoch < max_epochs and trainer.global_step < max_steps:
        trainer.current_epoch = epoch
        trainer.validated_this_epoch = False
        accelerator.on_epoch_start(epoch, loader)
        if not skip:
            trainer.epoch_rng = rng_state()
        model.train()
        store.place = TRAIN_EPOCH  # what the epoch's start hooks log is the epoch's
        hooks("on_epoch_start")
        hooks("on_train_epoch_start")
        store.place = TRAIN_BATCH
        # the bar is called every ``bar_due`` steps (progress.py): an integer test a step
        bar_due, unshown = bar.start_epoch(epoch, _length(loader)), 0
        pending = tracked.pending  # close_chunk empties it in place
        trainer.in_epoch = True
        batch_idx = -1  # stays -1 when the loader yields nothing
        micro = 0  # micro-batches accumulated since the last optimizer step
        for batch_idx, batch in enumerate(batches):
            if tracked.unread:  # the step that closed a chunk has run: read it now
                tracked.read_chunks()
            if skip:  # resuming inside an epoch: draw the same batches, train on the rest
                skip -= 1
                if not skip and resume_rng is not None and not rng_after_fetch:
                    set_rng_state(resume_rng)
                    resume_rng = None
                continue
            if batch_idx >= limit:
                break
            if resume_rng is not None:  # saved inside training_step, after its batch was drawn
                set_rng_state(resume_rng)
                resume_rng = None
            if to_device is not None:
                batch = to_device(batch)
            store.batch = batch
            if watched:
                beat()
            if hooked:
                output, loss, stepped = _hooked_step(
                    trainer,
                    accelerator,
                    step,
                    batch,
                    batch_idx,
                    micro,
                    epoch_length if ahead is None else batch_idx + 1 if ahead.last else None,
                    turns,
                    indexed_backward,
                    optimizer_step,
                    stop,
                    beat,
                    watched,
                    before_zero_grad,
                    batch_start_cb,
                    batch_start,
                    step_end,
                    after_backward,
                    skip_sync,
                    accumulate,
                    clip,
                    clip_algorithm,
                )
                if output is _END_EPOCH:
                    break
                if collect:
                    outputs.append(_detached(output))
                if not stepped:
                    micro += 1
                    kept = keep(loss)
                    pending.append(kept)
                    if len(pending) == LOSS_CHUNK:
                        tracked.close_chunk(trainer.global_step, batch_idx)
                    trainer.batch_idx = batch_idx + 1
                    if batch_end_cb is not None:
                        batch_end_cb()
                    if batch_end is not None:
                        batch_end(output, batch, batch_idx, 0)
                    continue
                micro = 0
            else:
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
            if step_values and trainer.global_step % log_every == 0:
                write_metrics(
                    trainer,
                    {**store.take_step_values(), "epoch": float(epoch)},
                    trainer.global_step - 1,
                )
            if hooked:
                if batch_end_cb is not None:
                    batch_end_cb()
                if batch_end is not None:
                    batch_end(output, batch, batch_idx, 0)
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
        store.batch = None
        if unshown:  # the steps since the bar's last call
            bar.step(kept, batch, unshown)
        epoch_done = trainer.global_step < max_steps or trainer.batch_idx == epoch_length
        tracked.close_chunk(trainer.global_step - 1, trainer.batch_idx - 1)
        if batch_idx < 0 and not empty_warned:
            _no_batch(trainer, loader, epoch)
            empty_warned = True
        accelerator.on_epoch_end(trainer)
        trainer.record_losses(tracked.epoch())
        store.place = TRAIN_EPOCH
        if collect:
            returned = epoch_end(outputs)  # type: ignore[misc]
            if returned is not None:
                raise MisconfigurationError(
                    "training_epoch_end returned a value; it must return None (log what it "
                    "computes with self.log)."
                )
        last_step = max(trainer.global_step - 1, 0)
        logged = store.close_epoch("the training epoch (training_step, training_epoch_end)")
        if step_values:  # what the last steps logged since the last write
            logged = {**store.take_step_values(), **logged}
        if logged:
            write_metrics(trainer, {**logged, "epoch": float(epoch)}, last_step)
        # until the next epoch starts, a checkpoint resumes at the next epoch (loop_state)
        trainer.epoch_finished = epoch_done
        metrics: dict[str, float] = {}
        if (
            val_loaders
            and flags.limit_val_batches != 0
            and (epoch + 1) % flags.check_val_every_n_epoch == 0
        ):
            metrics = run_validation(trainer, accelerator, val_loaders, beat)
        hooks("on_train_epoch_end", outputs)
        hooks("on_epoch_end")
        outputs = []
        late = store.close_epoch("on_train_epoch_end / on_epoch_end")  # this epoch's values
        if late:
            write_metrics(trainer, {**late, "epoch": float(epoch)}, last_step)
        if epoch_done and epoch_schedulers:  # after validation: a monitor sees this epoch's
            step_due(trainer, epoch_schedulers, epoch + 1)
        logger = trainer.logger
        if logger is not None and trainer.is_global_zero:
            logger.save()
        bar.end_epoch(metrics)
        stop_now = _agreed_stop(trainer, accelerator)
        if epoch_done:
            trainer.current_epoch, trainer.batch_idx = epoch + 1, 0
        trainer.epoch_finished = False
        epoch += 1
        if stop_now and epoch >= min_epochs:
            break
    store.place = None
    hooks("on_train_end")
    _finish(trainer)


_END_EPOCH = object()


def _hooked_step(
    trainer: Trainer,
    accelerator: Strategy,
    step: Callable[..., Any],
    batch: Any,
    batch_idx: int,
    micro: int,
    epoch_length: float | int | None,
    turns: list[_Turn],
    backward: Callable[[torch.Tensor, int], Any],
    optimizer_step: Callable[[torch.optim.Optimizer], Any],
    stop: Callable[[torch.Tensor, int], None] | None,
    beat: Callable[[], None],
    watched: bool,
    before_zero_grad: Callable[..., Any] | None,
    batch_start_cb: Callable[..., Any] | None,
    batch_start: Callable[..., Any] | None,
    step_end: Callable[..., Any] | None,
    after_backward: Callable[..., Any] | None,
    skip_sync: Callable[[], Any],
    accumulate: int,
    clip: float,
    clip_algorithm: str,
) -> tuple[Any, torch.Tensor, bool]:
    """One batch with hooks, accumulation, clipping or optimizers stepped in turn:
    ``(output, loss, stepped)``, where ``stepped`` says whether the optimizers stepped (the
    last micro-batch of ``accumulate``, or the epoch's last batch). ``output`` is
    ``_END_EPOCH`` when a batch-start hook returned -1 (Lightning 1.0: the epoch ends
    there).

    With one turn of index None the step runs once and every optimizer steps on its
    backward. With a turn per optimizer (``training_step`` takes ``optimizer_idx``), each in
    order has its
    own turn, as in Lightning 1.0: the other optimizers' parameters are frozen while
    ``training_step(batch, batch_idx, optimizer_idx=i)`` and its backward run; on a stepping
    batch its gradients are then clipped and it steps before the next turn. The batch's
    output is then the list of each turn's."""
    precision = accelerator.precision
    optimizers = trainer.optimization.optimizers
    if batch_start_cb is not None:
        batch_start_cb()
    if batch_start is not None and batch_start(batch, batch_idx, 0) == -1:
        return _END_EPOCH, torch.zeros(()), False
    final = (
        accumulate == 1
        or (micro + 1) % accumulate == 0
        or (epoch_length is not None and batch_idx + 1 >= epoch_length)
    )
    if micro == 0:
        for optimizer in optimizers:
            optimizer.zero_grad()
    outputs: list[Any] = []
    loss = torch.zeros(())
    for turn in turns:
        frozen = turn.freeze()
        kwargs = {} if turn.index is None else {"optimizer_idx": turn.index}
        try:
            with skip_sync() if not final else contextlib.nullcontext():
                if precision.autocast is None:
                    output = step(batch, batch_idx, **kwargs)
                else:
                    with precision.autocast():
                        output = step(batch, batch_idx, **kwargs)
                if watched:
                    beat()
                if step_end is not None:
                    output = step_end(output)
                loss = extract_loss(output)
                if stop is not None:
                    stop(loss, batch_idx)
                backward(loss / accumulate if accumulate > 1 else loss, turn.index or 0)
        finally:
            for parameter in frozen:
                parameter.requires_grad_(True)
        outputs.append(output)
        if not final:
            continue
        owned = turn.optimizers
        if after_backward is not None or clip > 0:
            precision.unscale(owned)
        if after_backward is not None:
            after_backward()
        if clip > 0:
            for optimizer in owned:
                accelerator.clip_gradients(optimizer, clip, clip_algorithm)
        for optimizer in owned:
            optimizer_step(optimizer)
        if before_zero_grad is not None:  # Lightning 1.0: after the step, before zero_grad
            for optimizer in owned:
                before_zero_grad(optimizer)
                optimizer.zero_grad()
    output = outputs if turns[0].index is not None else outputs[0]
    return output, loss if final else loss.detach(), final


class _Turn:
    """One optimizer's turn in a batch (``index``: its ``optimizer_idx``; None: one step for
    every optimizer). The parameters it does not hold are frozen for its step and backward
    (Lightning 1.0's ``toggle_optimizer``; here they are given back after, and a parameter
    the user froze stays frozen)."""

    def __init__(
        self,
        index: int | None,
        optimizers: list[torch.optim.Optimizer],
        others: tuple[torch.nn.Parameter, ...],
    ):
        self.index = index
        self.optimizers = optimizers
        self._others = others

    def freeze(self) -> list[torch.nn.Parameter]:
        frozen = [p for p in self._others if p.requires_grad]
        for parameter in frozen:
            parameter.requires_grad_(False)
        return frozen


def _turns(
    model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], per_optimizer: bool
) -> list[_Turn]:
    """A batch's turns: one per optimizer for a model whose ``training_step`` takes
    ``optimizer_idx``; else one turn (index None) in which every optimizer steps."""
    if not per_optimizer:
        return [_Turn(None, optimizers, ())]
    parameters = list(model.parameters())
    turns = []
    for index, optimizer in enumerate(optimizers):
        own = {id(p) for group in optimizer.param_groups for p in group["params"]}
        turns.append(_Turn(index, [optimizer], tuple(p for p in parameters if id(p) not in own)))
    return turns


class _Lookahead:
    """A loader's batches, each yielded once the next one is fetched: ``last`` is True
    while the batch just yielded is the loader's last (a loader without ``len``)."""

    def __init__(self, loader: Iterable[Any]):
        self._loader = loader
        self.last = False

    def __iter__(self) -> Iterator[Any]:
        self.last = False
        batches = iter(self._loader)
        try:
            held = next(batches)
        except StopIteration:
            return
        for following in batches:
            yield held
            held = following
        self.last = True
        yield held


def _start(
    trainer: Trainer, accelerator: Strategy, val_loaders: list[Any], beat: Callable[[], None]
) -> None:
    """Before the first epoch: the hyperparameters to the logger, ``on_fit_start``, the
    sanity check (``num_sanity_val_steps``), ``on_train_start``."""
    hooks = trainer.hooks
    logger = trainer.logger
    if logger is not None and trainer.is_global_zero:
        hparams = getattr(trainer.lightning_module, "hparams", None)
        if hparams:
            logger.log_hyperparams(
                dict(vars(hparams)) if not isinstance(hparams, dict) else dict(hparams)
            )
    hooks("on_fit_start")
    hooks("on_pretrain_routine_start")
    hooks("on_pretrain_routine_end")
    sanity = trainer.flags.num_sanity_val_steps
    checked = sanity and val_loaders and trainer.flags.limit_val_batches != 0
    if checked and not trainer.flags.fast_dev_run and trainer.global_step == 0:
        trainer.sanity_checking = True
        hooks("on_sanity_check_start")
        try:  # at most the batches limit_val_batches lets a validation run (Lightning 1.0)
            run_validation(
                trainer, accelerator, val_loaders, beat, sanity=math.inf if sanity < 0 else sanity
            )
        finally:
            trainer.sanity_checking = False
        hooks("on_sanity_check_end")
    hooks("on_train_start")


def _finish(trainer: Trainer) -> None:
    """After the last epoch: the logger's ``finalize`` on rank 0, ``on_fit_end``."""
    logger = trainer.logger
    if logger is not None and trainer.is_global_zero:
        logger.finalize("success")
    trainer.hooks("on_fit_end")
    trainer.hooks("teardown", "fit")


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


def _positional_count(function: Any) -> int:
    """How many positional arguments ``function`` takes (a ``*args``: many)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return 0
    kinds = [p.kind for p in parameters]
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        return 1 << 16
    return sum(
        k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        for k in kinds
    )


_STAGES = {
    "validation_step": ("validation", "on_validation"),
    "test_step": ("test", "on_test"),
}


def evaluate_loaders(
    trainer: Trainer,
    accelerator: Strategy,
    loaders: Iterable[Any],
    step_name: str,
    prefix: str,
    beat: Callable[[], None] = _still,
    sanity: float | None = None,
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """Run ``step_name`` over ``loaders`` without gradients, with its hooks; return the mean
    metrics over every loader (what the logger and ``callback_metrics`` get) and each
    loader's own (Lightning 1.0's results: with several loaders a step's names end in
    ``/dataloader_idx_<i>``; what the epoch-end hooks logged or returned is in each).

    Runs under ``fork_rng`` so that evaluating changes no random state training uses.
    Each loader runs the batches ``limit_val_batches`` / ``limit_test_batches`` allow, and at
    most ``sanity`` (the sanity check's count) when given.
    """
    model = trainer.model
    hooks = trainer.hooks
    store = trainer.metrics
    stage, on = _STAGES.get(step_name, (step_name.removesuffix("_step"), "on_" + prefix))
    step = trainer.evaluation_step_function(accelerator, step_name)
    step_end = getattr(model, f"{stage}_step_end", None)
    if not callable(step_end) or getattr(step, "calls_step_end", False):
        step_end = None
    epoch_end = getattr(model, f"{stage}_epoch_end", None)
    batch_start = hooks.get(f"{on}_batch_start")
    batch_end = hooks.get(f"{on}_batch_end")
    to_device = accelerator.batch_to_device if accelerator.moves_batches else None
    autocast = accelerator.precision.autocast
    devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    flags = trainer.flags
    fast = flags.fast_dev_run
    limit_flag = f"limit_{'val' if prefix == 'val' else prefix}_batches"
    wanted = (1 if fast is True else fast) if fast else getattr(flags, limit_flag, 1.0)
    loaders = list(loaders)
    several = len(loaders) > 1
    takes_loader_index = _positional_count(getattr(model, step_name, None)) >= 3
    sizes: list[list[tuple[dict[str, torch.Tensor], int]]] = [[] for _ in loaders]
    logged: list[dict[str, Any]] = []  # each loader's self.log values, held apart
    outputs: list[list[Any]] = [[] for _ in loaders]
    was_training = model.training
    hooks(f"{on}_start")
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        model.eval()
        hooks(f"{on}_epoch_start")
        store.place = EVAL_BATCH
        for index, loader in enumerate(loaders):
            most = batch_limit(wanted, _length(loader), limit_flag)
            if sanity is not None:
                most = min(most, sanity)
            extra = (index,) if several and takes_loader_index else ()
            for batch_idx, batch in enumerate(loader):
                if batch_idx >= most:
                    break
                beat()
                size = batch_size(batch)
                if to_device is not None:
                    batch = to_device(batch)
                store.batch = batch
                if batch_start is not None:
                    batch_start(batch, batch_idx, index)
                if autocast is None:
                    output = step(batch, batch_idx, *extra)
                else:
                    with autocast():
                        output = step(batch, batch_idx, *extra)
                if step_end is not None:
                    output = step_end(output)
                if batch_end is not None:
                    batch_end(output, batch, batch_idx, index)
                if callable(epoch_end):
                    outputs[index].append(output)
                sizes[index].append((metrics_of(output, prefix), size))
            logged.append(store.take_epoch())
        store.batch = None
        store.place = EVAL_EPOCH
        returned = None
        if callable(epoch_end) and any(sizes):  # Lightning 1.0: not after no batch at all
            returned = epoch_end(outputs[0] if len(loaders) == 1 else outputs)
    model.train(was_training)
    # A mean weighted by batch size, over every rank: each rank's sums of value x size and
    # of sizes, added up in one collective, then divided (over every loader, and with
    # several loaders over each loader too).
    blocks = [weighted_sums(item for part in sizes for item in part)]
    if several:
        blocks += [weighted_sums(part) for part in sizes]
    layout = [(b, key) for b, block in enumerate(blocks) for key in sorted(block)]
    if accelerator.world_size > 1:  # what every rank is about to reduce: the same names
        helds = [*logged, store.epoch_held()]  # each loader's self.log values, the epoch end's
        names = [f"{key} (returned" + (f", loader {b - 1})" if b else ")") for b, key in layout]
        if several:
            names += [
                f"{n} (logged, loader {i})"
                for i, held in enumerate(logged)
                for n in store.synced(held)
            ]
        names += store.synced(*helds)
        runs = f"{stage} batches per loader: {[len(part) for part in sizes]}"
        steps_ok, steps = store.steps_agreed()
        agreement.agree(
            accelerator,
            f"{step_name} / {stage}_epoch_end",
            names,
            note=runs,
            steps_ok=steps_ok,
            steps=steps,
        )
    exact = torch.float64 if accelerator.device.type in ("cpu", "cuda") else torch.float32
    local = torch.tensor(
        [part for b, key in layout for part in blocks[b][key]],
        dtype=exact,
        device=accelerator.device,
    )
    total = accelerator.reduce(local, op="sum").cpu().tolist() if layout else []
    means: list[dict[str, float]] = [{} for _ in blocks]
    for i, (b, key) in enumerate(layout):
        means[b][key] = total[2 * i] / total[2 * i + 1] if total[2 * i + 1] else math.nan
    reduced = means[0]
    epoch_level: dict[str, float] = {}
    if isinstance(returned, dict):  # Lightning 1.0's dict from *_epoch_end: its scalars
        epoch_level.update(
            {
                str(k): float(v)
                for k, v in returned.items()
                if isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.numel() == 1)
            }
        )
    reduced.update(epoch_level)
    if several:  # each loader's self.log means (across ranks for sync_dist), kept apart
        epoch_held = store.take_epoch()  # what the epoch-end hook logged
        for index, held in enumerate(logged):
            store.put_epoch(held)
            means[index + 1].update(store.close_epoch(agreed=True))
        for held in logged:
            store.put_epoch(held)
        store.put_epoch(epoch_held)
        late_names = set(epoch_held)
    else:
        store.put_epoch(logged[0] if logged else {})
        late_names = set()
    reduced.update(store.close_epoch(agreed=True))
    sanity_check = trainer.sanity_checking
    if not sanity_check:  # on_*_epoch_end sees this run's means
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in reduced.items()})
    hooks(f"{on}_epoch_end")
    late = store.close_epoch(f"on_{stage}_epoch_end")  # what on_*_epoch_end logged
    store.place = None
    if sanity_check:
        hooks(f"{on}_end")
        return {}, []
    reduced.update(late)
    trainer.callback_metrics.update({k: torch.tensor(v) for k, v in late.items()})
    if reduced:
        at = max(trainer.global_step - 1, 0)
        write_metrics(trainer, {**reduced, "epoch": float(trainer.current_epoch)}, at)
    hooks(f"{on}_end")
    if not several:
        return reduced, [dict(reduced)]
    shared = {k: v for k, v in reduced.items() if k in {*epoch_level, *late, *late_names}}
    per_loader = [
        {**{f"{k}/dataloader_idx_{index}": v for k, v in own.items()}, **shared}
        for index, own in enumerate(means[1:])
    ]
    return reduced, per_loader


def run_validation(
    trainer: Trainer,
    accelerator: Strategy,
    loaders: list[Any],
    beat: Callable[[], None] = _still,
    sanity: float | None = None,
) -> dict[str, float]:
    """Validate during ``fit``; ``sanity``: the sanity check's batches per loader."""
    if not callable(getattr(trainer.model, "validation_step", None)):
        return {}
    place = trainer.metrics.place
    try:
        metrics = evaluate_loaders(
            trainer, accelerator, loaders, "validation_step", "val", beat, sanity
        )[0]
    finally:
        trainer.metrics.place = place
    if not trainer.sanity_checking:
        trainer.validated_this_epoch = True
    return metrics
