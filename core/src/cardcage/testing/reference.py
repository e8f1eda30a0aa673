"""Plain PyTorch loops the kit compares every backend against.

``world`` processes of ``batch`` samples each train like one process of ``world * batch``
samples: each step's global batch is the union of what ``DistributedSampler`` gives each
rank, and the gradient is the mean over ranks of each rank's mean loss (what
DistributedDataParallel's averaging computes). One process (``world == 1``) is a plain
``DataLoader`` loop, drawing its shuffles from the global random state as the job does.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from cardcage.testing.models import (
    SAMPLES,
    VAL_SAMPLES,
    Regression,
    flat,
    held_state,
    loader,
    make_net,
    make_optimizers,
)


def _rank_batches(
    samples: int, batch: int, world: int, rank: int, epoch: int, shuffle: bool, drop_last: bool
) -> list[list[int]]:
    sampler: DistributedSampler[int] = DistributedSampler(
        range(samples),  # type: ignore[arg-type]  # a sized sequence is all it needs
        num_replicas=world,
        rank=rank,
        shuffle=shuffle,
        drop_last=drop_last,
    )
    sampler.set_epoch(epoch)
    indices = list(sampler)
    chunks = [indices[i : i + batch] for i in range(0, len(indices), batch)]
    if drop_last and chunks and len(chunks[-1]) < batch:
        chunks.pop()
    return chunks


def global_batches(
    data: Regression, batch: int, world: int, epoch: int, shuffle: bool, drop_last: bool
) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each step's batches, one per rank (drawing the epoch's shuffle when ``world == 1``)."""
    if world == 1:
        for x, y in loader(len(data), batch, shuffle=shuffle, drop_last=drop_last):
            yield [(x, y)]
        return
    per_rank = [
        _rank_batches(len(data), batch, world, r, epoch, shuffle, drop_last) for r in range(world)
    ]
    for step in zip(*per_rank, strict=True):
        yield [(data.x[idx], data.y[idx]) for idx in step]


def train(model: torch.nn.Module, kind: str, **options: Any) -> int:
    """Train ``model`` as the job's scenario would; returns the number of steps taken
    (:func:`run`'s options)."""
    steps, _ = run(model, kind, **options)
    return steps


def run(
    model: torch.nn.Module,
    kind: str,
    *,
    batch: int,
    world: int,
    epochs: int | None,
    samples: int = SAMPLES,
    shuffle: bool = False,
    drop_last: bool = False,
    max_steps: int | None = None,
    resize: tuple[int, int] | None = None,
    accumulate: int = 1,
    clip: tuple[str, float] | None = None,
    turns: bool = False,
) -> tuple[int, list[torch.optim.Optimizer]]:
    """Train ``model`` as the job's scenario would; returns the number of steps taken and
    the optimizers as they are after them.

    ``resize=(epoch, world)``: from that epoch on, train at that world size (a run resumed
    from an epoch's checkpoint by a job of another size). ``accumulate=N``: each optimizer
    step takes the gradients of N consecutive global batches, each loss divided by N (the
    last, shorter group of an epoch too, as Lightning 1.0 divides it). ``clip=(algorithm,
    value)``: before each step, each optimizer's gradients clipped by their total 2-norm
    (``"norm"``) or element-wise (``"value"``). ``turns``: the optimizers step one after
    the other (Lightning 1.0's ``optimizer_idx``): each optimizer's backward runs with the
    other optimizers' parameters frozen, and on a group's last batch it is clipped and
    steps before the next optimizer's forward. A scheduler given as a dict with
    ``"interval": "step"`` steps after every optimizer step; the others after each epoch
    that ran to its end."""
    optimizers, configured = make_optimizers(model, kind)  # type: ignore[arg-type]
    per_step = [c["scheduler"] for c in configured if isinstance(c, dict)]
    per_epoch = [c for c in configured if not isinstance(c, dict)]
    data = Regression(samples)
    limit = max_steps if max_steps is not None else math.inf
    last = epochs if epochs is not None else math.inf
    step, epoch = 0, 0
    while epoch < last and step < limit:
        size = resize[1] if resize is not None and epoch >= resize[0] else world
        batches = list(global_batches(data, batch, size, epoch, shuffle, drop_last))
        steps = [batches[i : i + accumulate] for i in range(0, len(batches), accumulate)]
        taken = 0
        for group in steps:
            for optimizer in optimizers:
                optimizer.zero_grad()
            if turns:
                _turns(model, optimizers, group, accumulate, clip)
            else:
                for parts in group:
                    _backward(model, parts, accumulate)
                if clip is not None:
                    for optimizer in optimizers:
                        clip_gradients(optimizer, *clip)
                for optimizer in optimizers:
                    optimizer.step()
            step, taken = step + 1, taken + 1
            for scheduler in per_step:
                scheduler.step()
            if step >= limit:
                break
        if step < limit or taken == len(steps):  # the epoch ran to its end
            for scheduler in per_epoch:
                scheduler.step()
        epoch += 1
    return step, optimizers


def _backward(
    model: torch.nn.Module, parts: list[tuple[torch.Tensor, torch.Tensor]], accumulate: int
) -> None:
    losses = [torch.nn.functional.mse_loss(model(x), y) for x, y in parts]
    (torch.stack(losses).mean() / accumulate).backward()  # type: ignore[no-untyped-call]


def _turns(
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    group: list[list[tuple[torch.Tensor, torch.Tensor]]],
    accumulate: int,
    clip: tuple[str, float] | None,
) -> None:
    """One optimizer step of each optimizer in turn over an accumulated ``group``."""
    for position, parts in enumerate(group):
        for optimizer in optimizers:
            own = {id(p) for g in optimizer.param_groups for p in g["params"]}
            others = [p for p in model.parameters() if id(p) not in own]
            for parameter in others:
                parameter.requires_grad_(False)
            _backward(model, parts, accumulate)
            for parameter in others:
                parameter.requires_grad_(True)
            if position == len(group) - 1:
                if clip is not None:
                    clip_gradients(optimizer, *clip)
                optimizer.step()


def clip_gradients(optimizer: torch.optim.Optimizer, algorithm: str, value: float) -> None:
    """Clip the gradients of ``optimizer``'s parameters as one process would."""
    parameters = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if algorithm == "norm":
        torch.nn.utils.clip_grad_norm_(parameters, value)
    else:
        torch.nn.utils.clip_grad_value_(parameters, value)


def first_gradient_norm(*, batch: int, world: int, accumulate: int = 1, seed: int = 0) -> float:
    """The total 2-norm of the gradients of the plain loop's first optimizer step (whatever
    the optimizer), before any clipping: of its ``accumulate`` global batches, as one
    process holds them once the ranks' gradients are averaged."""
    model = make_net(seed)
    data = Regression(SAMPLES)
    batches = global_batches(data, batch, world, 0, shuffle=False, drop_last=False)
    for _, parts in zip(range(accumulate), batches, strict=False):
        losses = [torch.nn.functional.mse_loss(model(x), y) for x, y in parts]
        (torch.stack(losses).mean() / accumulate).backward()  # type: ignore[no-untyped-call]
    grads = [p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]
    return float(torch.cat(grads).norm())


def weights(kind: str, *, seed: int = 0, **options: Any) -> list[float]:
    """Final weights of the plain loop for a fresh model of ``seed``."""
    model = make_net(seed)
    train(model, kind, **options)
    return flat(model)


def steps(kind: str, *, seed: int = 0, **options: Any) -> int:
    """How many optimizer steps the plain loop takes (``train``'s options)."""
    return train(make_net(seed), kind, **options)


def learning_rates(kind: str, *, seed: int = 0, **options: Any) -> list[float]:
    """The learning rate of each parameter group of each optimizer after the plain loop."""
    _, optimizers = run(make_net(seed), kind, **options)
    return [float(group["lr"]) for o in optimizers for group in o.param_groups]


def state_elements(kind: str) -> int:
    """How many elements the per-parameter state of ``kind``'s optimizers holds in all, once
    they stepped (Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum_buffer``)."""
    model = make_net(0)
    optimizers, _ = make_optimizers(model, kind)
    data = Regression(4)
    torch.nn.functional.mse_loss(model(data.x), data.y).backward()  # type: ignore[no-untyped-call]
    for optimizer in optimizers:
        optimizer.step()
    return held_state(optimizers)


def metrics(weights_of: list[float]) -> dict[str, float]:
    """Validation (mse) and test (l1) means over the validation data for given weights."""
    model = make_net(0)
    with torch.no_grad():
        offset = 0
        for parameter in model.parameters():
            count = parameter.numel()
            values = torch.tensor(weights_of[offset : offset + count], dtype=parameter.dtype)
            parameter.copy_(values.reshape(parameter.shape))
            offset += count
        data = Regression(VAL_SAMPLES)
        prediction = model(data.x)
        return {
            "val_loss": float(torch.nn.functional.mse_loss(prediction, data.y)),
            "test_loss": float(torch.nn.functional.l1_loss(prediction, data.y)),
        }
