"""The conformance kit's own-loop scenarios: the kit's trainings as a user's own PyTorch loop
through :class:`cardcage.Cage`.

The kit's job (:mod:`cardcage.testing.job`) builds ``cardcage.Cage`` from its launch's flags
(those the Cage takes) and calls ``cage.launch(train, plan)`` once for all the own-loop
scenarios it runs, so each launch starts its training processes once more. :func:`train` runs
in every training process (a spawned worker, a relaunched script, a process torchrun or
horovodrun started, or the job itself); each rank builds its nets from a seed of its own
(rank 0 from the plain loop's, see :func:`~cardcage.testing.models.seed_for_rank`) and
writes, for each scenario, ``<scenario>-rank<global rank>.json``. It first writes
``cage_launch-rank<R>.json`` (which backend and rule, its pid) and, once every scenario ran,
the same with the value it returns to ``launch``; every process that called ``launch``
writes what ``launch`` returned to it in ``cage_launch-returned-<pid>.json``, which must be
rank 0's.

Scenarios: ``cage_sgd`` (momentum SGD; Adam with a StepLR each epoch on shuffled data;
momentum SGD clipped by total norm after 2 accumulated micro-batches, and clipped by value),
``cage_accumulate`` (``no_backward_sync`` accumulation of ``ACCUMULATE`` micro-batches, as
``accumulate_grad_batches``), ``cage_resume`` (Adam on shuffled data for one epoch,
``cage.save``, other weights ``cage.load`` it and train two more), ``cage_collectives``
(``all_reduce``, ``all_gather``, ``broadcast``, ``barrier``) and ``cage_fail`` (rank 1
raises at its second step; it runs alone, in a job of its own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

import cardcage
from cardcage.testing.models import (
    RANK_SEED_STEP,
    SAMPLES,
    loader,
    make_net,
    make_schedulers,
    new_optimizers,
)

#: The own-loop scenarios whose weights are checked against the plain loop.
TRAINING = ("cage_sgd", "cage_accumulate", "cage_resume")
#: The scenario of the collectives, and the one whose rank 1 fails (in a job of its own).
COLLECTIVES, FAIL = "cage_collectives", "cage_fail"
#: What each training process of a launch writes first, and again with its return value.
LAUNCH = "cage_launch"
#: ``cage_accumulate``'s micro-batches per optimizer step: each epoch's last group is shorter.
ACCUMULATE = 3
#: ``cage_sgd``'s limits: the total gradient norm (with 2 micro-batches a step), each element.
CLIP_NORM, CLIP_VALUE, CLIP_ACCUMULATE = 0.2, 0.05, 2
#: The file ``cage_resume`` saves after one epoch and loads into other weights.
RESUME_CHECKPOINT = "cage_resume.ckpt"
#: ``cage_collectives``: each rank's tensor is ``[rank + 1, SCALE * (rank + 1)]``.
SCALE = 10.0
#: What rank 1 raises in ``cage_fail``.
FAILURE = "injected own-loop failure on rank 1 at its second step"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every training process of one ``launch`` runs: the scenarios, in order, the
    per-process batch size and the job's output folder."""

    scenarios: tuple[str, ...]
    batch: int
    out: str


def cage_flags(flags: Mapping[str, Any]) -> dict[str, Any]:
    """The launch's flags that :class:`cardcage.Cage` takes: the backend's, not the loop's."""
    taken = inspect.signature(cardcage.Cage).parameters.values()
    names = {p.name for p in taken if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD}
    return {name: value for name, value in flags.items() if name in names}


def write(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` at once (a reader never sees half of it)."""
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(data))
    os.replace(partial, path)


def run(flags: Mapping[str, Any], scenarios: list[str], batch: int, out: Path) -> Any:
    """In the job's process: one ``launch`` of :func:`train` for ``scenarios``; writes what
    ``launch`` returned here."""
    cage = cardcage.Cage(**cage_flags(flags))
    value = cage.launch(train, Plan(tuple(scenarios), batch, str(out)))
    write(out / f"{LAUNCH}-returned-{os.getpid()}.json", {"pid": os.getpid(), "value": value})
    return value


def train(cage: cardcage.Cage, plan: Plan) -> dict[str, Any]:
    """In every training process: each scenario of ``plan``, its result written per rank.
    Returns this rank's number and pid and each scenario's last loss (``launch`` must hand
    rank 0's to every process that called it)."""
    out, rank = Path(plan.out), cage.global_rank
    started = {
        "rank": rank,
        "world": cage.world_size,
        "pid": os.getpid(),
        "accelerator": cage.selection.accelerator,
        "rule": cage.selection.rule,
    }
    write(out / f"{LAUNCH}-rank{rank}.json", started)
    losses: dict[str, float] = {}
    for name in plan.scenarios:
        result, losses[name] = SCENARIOS[name](cage, plan)
        result.update(rank=rank, pid=os.getpid())
        write(out / f"{name}-rank{rank}.json", result)
    value = {"rank": rank, "pid": os.getpid(), "losses": losses}
    write(out / f"{LAUNCH}-rank{rank}.json", {**started, "returned": value})
    return value


# -- training, as a user writes it ------------------------------------------------------------


@dataclasses.dataclass
class Training:
    """A net set up with its optimizer, its schedulers and its loader."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedulers: list[Any]
    loader: Any


def set_up(
    cage: cardcage.Cage, kind: str, batch: int, seed: int = 0, shuffle: bool = False
) -> Training:
    """This rank's net (rank 0's from the plain loop's seed) and the optimizer of ``kind``,
    created before ``setup`` as a plain script does; the schedulers over the optimizer that
    ``setup`` returned; a fresh loader (its epochs count from 0) through
    ``setup_dataloaders``."""
    net = make_net(seed + RANK_SEED_STEP * cage.global_rank)
    model, optimizer = cage.setup(net, *new_optimizers(net, kind))
    data = cage.setup_dataloaders(loader(SAMPLES, batch, shuffle=shuffle))
    return Training(model, optimizer, make_schedulers([optimizer], kind), data)


def fit(
    cage: cardcage.Cage,
    run: Training,
    epochs: int,
    *,
    start: int = 0,
    accumulate: int = 1,
    clip: dict[str, float] | None = None,
    fail: bool = False,
    probe: Callable[[], None] | None = None,
) -> tuple[int, float, float | None]:
    """Epochs ``start`` .. ``epochs - 1`` of the plain loop's training: with ``accumulate``,
    an optimizer step every ``accumulate`` batches and at each epoch's end, each loss divided
    by ``accumulate``, every micro-batch before a step's last inside ``no_backward_sync``;
    ``clip`` (``max_norm`` or ``clip_val``) before each step; the schedulers after each epoch.
    ``probe`` runs after the first backward inside ``no_backward_sync``; with ``fail``, rank
    1 raises at its second batch. Returns the optimizer steps taken, the last micro-batch's
    loss and the gradients' norm before the first clip by ``max_norm``."""
    steps, last_loss, first_norm = 0, 0.0, None
    for _ in range(start, epochs):
        count = len(run.loader)
        for index, (x, y) in enumerate(run.loader):
            if fail and cage.global_rank == 1 and index == 1:
                raise RuntimeError(FAILURE)
            if index % accumulate == 0:
                run.optimizer.zero_grad()
            last = (index + 1) % accumulate == 0 or index + 1 == count
            context = (
                cage.no_backward_sync(run.model, enabled=not last)
                if accumulate > 1
                else contextlib.nullcontext()
            )
            with context:
                loss = torch.nn.functional.mse_loss(run.model(x), y) / accumulate
                cage.backward(loss)
            if probe is not None and not last:
                probe()
                probe = None
            if not last:
                continue
            if clip is not None:
                norm = cage.clip_gradients(run.model, run.optimizer, **clip)
                if first_norm is None and norm is not None:
                    first_norm = float(norm)
            run.optimizer.step()
            steps += 1
            last_loss = float(loss.detach()) * accumulate
        for scheduler in run.schedulers:
            scheduler.step()
    return steps, last_loss, first_norm


def weights(module: torch.nn.Module) -> list[float]:
    """Every weight of ``module`` on this rank, whole (a sharded parameter gathered: every
    rank must call it), in the order of the user's net."""
    values: list[float] = []
    for parameter in module.parameters():
        data = parameter.detach()
        full_tensor = getattr(data, "full_tensor", None)
        if callable(full_tensor):
            data = full_tensor()
        values.extend(float(v) for v in data.cpu().reshape(-1))
    return values


# -- the scenarios ----------------------------------------------------------------------------


def cage_sgd(cage: cardcage.Cage, plan: Plan) -> tuple[dict[str, Any], float]:
    """Four trainings, two epochs each, each set up afresh: momentum SGD (``sgd``), Adam with
    its StepLR on shuffled data (``adam_shuffled``), momentum SGD clipped to a total norm of
    ``CLIP_NORM`` after ``CLIP_ACCUMULATE`` micro-batches (``clip_norm``, and the norm
    ``clip_gradients`` returned at the first step) and clipped to ``CLIP_VALUE`` element-wise
    (``clip_value``)."""
    sgd = set_up(cage, "sgd", plan.batch)
    _, loss, _ = fit(cage, sgd, 2)
    result: dict[str, Any] = {"sgd": weights(sgd.model)}
    # Nothing draws random numbers between the net's seed and the loader's first shuffle, as
    # in the plain loop (one process shuffles from the global generator).
    adam = set_up(cage, "adam", plan.batch, shuffle=True)
    fit(cage, adam, 2)
    result["adam_shuffled"] = weights(adam.model)
    by_norm = set_up(cage, "sgd", plan.batch)
    clip = {"max_norm": CLIP_NORM}
    _, _, result["first_norm"] = fit(cage, by_norm, 2, accumulate=CLIP_ACCUMULATE, clip=clip)
    result["clip_norm"] = weights(by_norm.model)
    by_value = set_up(cage, "sgd", plan.batch)
    fit(cage, by_value, 2, clip={"clip_val": CLIP_VALUE})
    result["clip_value"] = weights(by_value.model)
    return result, loss


def cage_accumulate(cage: cardcage.Cage, plan: Plan) -> tuple[dict[str, Any], float]:
    """Momentum SGD for two epochs, stepping every ``ACCUMULATE`` micro-batches. After the
    first backward inside ``no_backward_sync``, with several ranks whose gradients are plain
    tensors, ``local_gradients`` says whether they still differ between the ranks (they
    must: nothing was communicated); None where that cannot be seen (one rank, sharded
    gradients)."""
    run = set_up(cage, "sgd", plan.batch)
    seen: dict[str, bool | None] = {"local_gradients": None}

    def probe() -> None:
        grads = [p.grad for p in run.model.parameters()]
        if cage.world_size < 2 or any(g is None or type(g) is not torch.Tensor for g in grads):
            return
        mine = torch.cat([g.detach().reshape(-1) for g in grads if g is not None])
        every = cage.all_gather(mine).cpu()
        seen["local_gradients"] = bool((every - every[0]).abs().max() > 1e-7)

    steps, loss, _ = fit(cage, run, 2, accumulate=ACCUMULATE, probe=probe)
    return {"weights": weights(run.model), "steps": steps, **seen}, loss


def cage_resume(cage: cardcage.Cage, plan: Plan) -> tuple[dict[str, Any], float]:
    """Adam with its StepLR on shuffled data for one epoch, then ``cage.save`` of the model,
    the optimizer, and plain entries: the epoch, the scheduler's state and the random state
    (one process shuffles from it); then a net of other weights and a new Adam, set up,
    ``cage.load`` into them, the random state and the scheduler restored, the loader set to
    epoch 1 (``set_epoch``, where the Cage shards it), and epochs 1 and 2. ``rest`` is what
    ``load`` returned besides the modules and optimizers."""
    path = str(Path(plan.out) / RESUME_CHECKPOINT)
    first = set_up(cage, "adam", plan.batch, shuffle=True)
    fit(cage, first, 1)
    state = {"model": first.model, "optimizer": first.optimizer, "epoch": 1}
    plain = {"scheduler": first.schedulers[0].state_dict(), "rng": torch.get_rng_state()}
    cage.save(path, {**state, **plain})
    saved = weights(first.model)
    resumed = set_up(cage, "adam", plan.batch, seed=99, shuffle=True)
    rest = cage.load(path, {"model": resumed.model, "optimizer": resumed.optimizer})
    resumed.schedulers[0].load_state_dict(rest["scheduler"])
    torch.set_rng_state(rest["rng"])
    set_epoch = getattr(resumed.loader, "set_epoch", None)
    if callable(set_epoch):  # a sharded loader counts its epochs from 0 again
        set_epoch(rest["epoch"])
    _, loss, _ = fit(cage, resumed, 3, start=rest["epoch"])
    result = {"weights": saved, "resumed": weights(resumed.model), "rest": sorted(rest)}
    return {**result, "epoch": rest["epoch"]}, loss


def cage_collectives(cage: cardcage.Cage, plan: Plan) -> tuple[dict[str, Any], float]:
    """What each collective gave this rank for its tensor ``[rank + 1, SCALE * (rank + 1)]``
    (and the tensor after them: ``all_reduce`` returns a new one); ``broadcast`` of a dict
    from rank 1 (rank 0 with one process); then a ``barrier``."""
    rank, world = cage.global_rank, cage.world_size
    mine = cage.to_device(torch.tensor([rank + 1.0, SCALE * (rank + 1)]))
    mean = cage.all_reduce(mine, op="mean")
    total = cage.all_reduce(mine, op="sum")
    gathered = cage.all_gather(mine)
    src = 1 if world > 1 else 0
    sent = cage.broadcast({"from": rank, "items": [rank] * 3}, src=src)
    cage.barrier()
    result = {
        "mean": mean.cpu().tolist(),
        "sum": total.cpu().tolist(),
        "gathered": gathered.cpu().tolist(),
        "mine": mine.cpu().tolist(),
        "broadcast": sent,
        "src": src,
        "world": world,
    }
    return result, 0.0


def cage_fail(cage: cardcage.Cage, plan: Plan) -> tuple[dict[str, Any], float]:
    """Momentum SGD in which rank 1 raises at its second batch."""
    run = set_up(cage, "sgd", plan.batch)
    _, loss, _ = fit(cage, run, 1, fail=True)
    return {"weights": weights(run.model)}, loss


SCENARIOS: dict[str, Callable[[cardcage.Cage, Plan], tuple[dict[str, Any], float]]] = {
    "cage_sgd": cage_sgd,
    "cage_accumulate": cage_accumulate,
    "cage_resume": cage_resume,
    "cage_collectives": cage_collectives,
    "cage_fail": cage_fail,
}
