"""The conformance kit's model, data and lifecycle tracer.

Importing this module registers :data:`TRACER`, an in-process plugin that wraps the four
lifecycle hooks. It records nothing unless ``CARDCAGE_KIT_TRACE`` names a folder; then each
process appends one JSON line per event to ``trace-<pid>.jsonl`` there. Spawned workers import
this module when they unpickle the model, so they trace too.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from cardcage.callbacks import Callback
from cardcage.plugins import manager as plugins
from cardcage.plugins.spec import hookimpl

TRACE = "CARDCAGE_KIT_TRACE"
SCENARIO = "CARDCAGE_KIT_SCENARIO"
FEATURES = 4
HIDDEN = 3
#: Samples of the training data, of the validation data, and of the uneven scenarios.
SAMPLES, VAL_SAMPLES, UNEVEN_SAMPLES = 64, 32, 71
#: How far apart the seeds of different ranks' models are (see :func:`seed_for_rank`).
RANK_SEED_STEP = 1000
#: ``step_lr``'s StepLR, stepped after every optimizer step: at every step, lr times 0.9 (so
#: the learning rate after the last step tells a scheduler stepped even once too often or
#: too rarely from the right one).
STEP_LR_SIZE, STEP_LR_GAMMA = 1, 0.9


class _Current(threading.local):
    """The trainer this thread is fitting, for a model that checkpoints from a step (per
    thread: XLA's replicas on the CPU are threads of one process)."""

    trainer: Any = None


current = _Current()


class _Seeding:
    """What this process adds to the seed of every :class:`KitModel` it builds."""

    offset = 0


_seeding = _Seeding()


def seed_for_rank(rank: int) -> None:
    """Build this process's KitModels from ``seed + RANK_SEED_STEP * rank``: rank 0 from the
    plain loop's seed, every other rank from other initial weights. Only a backend that
    starts every rank from rank 0's weights (as DistributedDataParallel's constructor
    broadcasts them) then trains like the plain loop."""
    _seeding.offset = RANK_SEED_STEP * rank


def record(event: str, **details: Any) -> None:
    """Append an event of this process to the trace, when tracing."""
    folder = os.environ.get(TRACE)
    if not folder:
        return
    line = {
        "event": event,
        "pid": os.getpid(),
        "thread": threading.get_ident(),
        "scenario": os.environ.get(SCENARIO),
        **details,
    }
    with open(Path(folder) / f"trace-{os.getpid()}.jsonl", "a") as stream:
        stream.write(json.dumps(line) + "\n")


class Tracer:
    """Wraps the lifecycle hooks and records where and in which order they ran."""

    @hookimpl(wrapper=True)
    def cardcage_setup(self, trainer: Any, accelerator: Any) -> Generator[None, Any, Any]:
        record("setup")
        return (yield)

    @hookimpl(wrapper=True)
    def cardcage_train(self, trainer: Any, accelerator: Any) -> Generator[None, Any, Any]:
        record("train")
        return (yield)

    @hookimpl(wrapper=True)
    def cardcage_setup_process(self, trainer: Any, accelerator: Any) -> Generator[None, Any, Any]:
        current.trainer = trainer
        result = yield
        record(
            "setup_process",
            rank=accelerator.global_rank,
            world=accelerator.world_size,
            accelerator=trainer.selection.accelerator,
            rule=trainer.selection.rule,
        )
        return result

    @hookimpl(wrapper=True)
    def cardcage_teardown_process(
        self, trainer: Any, accelerator: Any
    ) -> Generator[None, Any, Any]:
        # Before the backend's teardown, which may gather or free what the optimizers hold.
        optimization = getattr(trainer, "optimization", None)
        held = held_state(getattr(optimization, "optimizers", []))
        try:
            return (yield)
        finally:
            record("teardown", rank=accelerator.global_rank, state_held=held)
            current.trainer = None


def held_state(optimizers: list[torch.optim.Optimizer]) -> int:
    """How many elements of the optimizers' per-parameter state (every tensor that is not a
    scalar, such as Adam's ``exp_avg`` or SGD's ``momentum_buffer``) this process holds: of
    a DTensor, its local shard only."""
    held = 0
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                for value in optimizer.state.get(parameter, {}).values():
                    if not isinstance(value, torch.Tensor) or value.dim() == 0:
                        continue
                    to_local = getattr(value, "to_local", None)
                    local = to_local() if callable(to_local) else value
                    held += local.numel()
    return held


TRACER = Tracer()
plugins.register(TRACER, name="cardcage-testing-tracer")


class Regression(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``(x, y)`` samples of a noisy non-linear target, the same in every process."""

    def __init__(self, samples: int, seed: int = 1234):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(samples, FEATURES, generator=generator)
        w = torch.arange(1.0, FEATURES + 1).unsqueeze(1)
        self.y = torch.tanh(self.x @ w) + 0.1 * torch.randn(samples, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def make_net(seed: int) -> torch.nn.Sequential:
    """The kit's net, its weights drawn as ``Linear``'s default (uniform within
    ``1/sqrt(fan_in)``) from a generator of its own seeded with ``seed``: threads that build
    nets at once (XLA's replicas on the CPU are threads of one process) each get their
    seed's. Torch's global generator is seeded with ``seed`` too, so that one process's
    shuffles after it draw as the plain loop's do."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1)
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in (net[0], net[2]):
            assert isinstance(layer, torch.nn.Linear)
            bound = 1.0 / math.sqrt(layer.in_features)
            layer.weight.uniform_(-bound, bound, generator=generator)
            layer.bias.uniform_(-bound, bound, generator=generator)
    return net


def make_optimizers(net: torch.nn.Module, kind: str) -> tuple[list[Any], list[Any]]:
    """The optimizers and schedulers of ``kind``: sgd (momentum), adam (with a StepLR each
    epoch), two, step_lr (momentum SGD with a StepLR after every optimizer step: a scheduler
    dict with ``"interval": "step"``)."""
    optimizers = new_optimizers(net, kind)
    return optimizers, make_schedulers(optimizers, kind)


def new_optimizers(net: torch.nn.Module, kind: str) -> list[torch.optim.Optimizer]:
    """The optimizers of ``kind`` over ``net``'s parameters (see :func:`make_optimizers`)."""
    if kind == "adam":
        return [torch.optim.Adam(net.parameters(), lr=0.01)]
    if kind == "two":
        first, second = net[0], net[2]  # type: ignore[index]
        return [
            torch.optim.SGD(first.parameters(), lr=0.05, momentum=0.9),
            torch.optim.Adam(second.parameters(), lr=0.01),
        ]
    return [torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)]


def make_schedulers(optimizers: list[torch.optim.Optimizer], kind: str) -> list[Any]:
    """The schedulers of ``kind`` over ``optimizers`` (those :func:`new_optimizers` made, or
    what a backend made of them): for adam, a StepLR stepped each epoch; for step_lr, one in
    a dict stepped after every optimizer step; none for the others."""
    if kind == "adam":
        return [torch.optim.lr_scheduler.StepLR(optimizers[0], step_size=1, gamma=0.5)]
    if kind == "step_lr":
        scheduler = torch.optim.lr_scheduler.StepLR(
            optimizers[0], step_size=STEP_LR_SIZE, gamma=STEP_LR_GAMMA
        )
        return [{"scheduler": scheduler, "interval": "step"}]
    return []


class KitModel(torch.nn.Module):
    """The model every scenario trains: the user's side of cardcage's contract."""

    def __init__(
        self, optimizer: str = "sgd", seed: int = 0, save_at: tuple[int, str] | None = None
    ):
        super().__init__()
        self.net = make_net(seed + _seeding.offset)  # rank 0: the plain loop's weights
        self.optimizer = optimizer
        self.save_at = save_at  # (global step, path): checkpoint from inside training_step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.net(x)
        return output

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        trainer = current.trainer
        if self.save_at is not None and trainer is not None:
            step, path = self.save_at
            if trainer.global_step == step:
                trainer.save_checkpoint(path)
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.l1_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        # In a training process (after setup_process), or a caller checking a checkpoint.
        record("configure_optimizers", training=current.trainer is not None, kind=self.optimizer)
        optimizers, schedulers = make_optimizers(self.net, self.optimizer)
        if schedulers and isinstance(schedulers[0], dict):  # Lightning 1.0's dict form
            return {"optimizer": optimizers[0], "lr_scheduler": schedulers[0]}
        return (optimizers, schedulers) if schedulers else optimizers


class TurnsModel(KitModel):
    """Two optimizers stepped in turn: ``training_step`` takes ``optimizer_idx``."""

    def training_step(  # type: ignore[override]
        self, batch: Any, batch_idx: int, optimizer_idx: int
    ) -> torch.Tensor:
        if optimizer_idx not in (0, 1):
            raise AssertionError(f"training_step got optimizer_idx={optimizer_idx!r}")
        return super().training_step(batch, batch_idx)


class EachTurnsOutput(Callback):
    """A batch hook (so the loop takes its hooked path) that checks it gets one output per
    optimizer, as Lightning 1.0's ``on_train_batch_end`` does for ``optimizer_idx`` steps."""

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int, index: int
    ) -> None:
        turns = len(trainer.optimization.optimizers)
        if not isinstance(outputs, list) or len(outputs) != turns:
            raise AssertionError(
                f"on_train_batch_end got outputs {outputs!r}, not one per optimizer ({turns})"
            )


class FailingModel(KitModel):
    """Rank 1 raises at its second step. Defined here, not in the job script, so that
    workers that get the script's classes by value (horovod.run's) still share ``current``
    with the tracer."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        trainer = current.trainer
        if trainer is not None and trainer.accelerator.global_rank == 1 and batch_idx == 1:
            raise RuntimeError("injected failure on rank 1 at its second step")
        return super().training_step(batch, batch_idx)


class MetricNamesModel(KitModel):
    """Rank 1's validation_step returns its loss under another name (``zzz``) than the
    other ranks' (``loss``): the ranks must refuse to reduce them together, naming both.
    Traces when each rank reaches its first validation batch (event
    ``metric_names_reached``, with the time)."""

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().validation_step(batch, batch_idx)
        trainer = current.trainer
        rank = trainer.accelerator.global_rank if trainer is not None else 0
        if batch_idx == 0:
            record("metric_names_reached", rank=rank, at=time.time())
        return {"zzz" if rank == 1 else "loss": loss}


class RecordFitEnd(Callback):
    """Traces, in every training process at the end of each fit, the rank's
    ``global_step``, ``current_epoch`` and the learning rate of each of its optimizers'
    parameter groups (event ``fit_end``): what the caller of a spawned run cannot see."""

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        optimizers = trainer.optimization.optimizers
        record(
            "fit_end",
            rank=trainer.global_rank,
            global_step=trainer.global_step,
            current_epoch=trainer.current_epoch,
            lrs=[float(group["lr"]) for o in optimizers for group in o.param_groups],
        )


class StopOnLastRank(Callback):
    """Asks to stop at the end of epoch 0 on the last rank only (global rank world size - 1);
    the other ranks never ask. The loop must stop every rank there, together."""

    def on_train_epoch_end(self, trainer: Any, pl_module: Any, outputs: Any) -> None:
        if trainer.current_epoch == 0 and trainer.global_rank == trainer.world_size - 1:
            trainer.should_stop = True


def loader(samples: int, batch_size: int, shuffle: bool = False, drop_last: bool = False) -> Any:
    return DataLoader(
        Regression(samples), batch_size=batch_size, shuffle=shuffle, drop_last=drop_last
    )


def flat(module: torch.nn.Module) -> list[float]:
    return [float(v) for p in module.parameters() for v in p.detach().reshape(-1)]
