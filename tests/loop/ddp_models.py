"""Models, callbacks and samplers that ddp_spawn workers unpickle by reference: the tests in
test_distributed_loop.py put this folder on ``sys.path`` (which spawned workers inherit)
and import this module as ``ddp_models``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import cardcage


def rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class PerRankBatches(torch.utils.data.Sampler[list[int]]):
    """A batch sampler whose batches differ by rank: ``plan[rank]`` is that rank's list of
    batches (lists of indices). The caller, outside any process group, sees rank 0's."""

    def __init__(self, plan: dict[int, list[list[int]]]):
        self.plan = plan

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.plan[rank()])

    def __len__(self) -> int:
        return len(self.plan[rank()])


class SyncLog(cardcage.Module):
    """Logs the mean of its inputs: per epoch across ranks (``t``, ``v``), per epoch on its
    own rank (``t_local``, ``v_local``), per step across ranks (``s``)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        self.log("t", x.mean(), on_step=False, on_epoch=True, sync_dist=True)
        self.log("t_local", x.mean(), on_step=False, on_epoch=True)
        self.log("s", x.mean(), sync_dist=True)
        return (self.w * x).pow(2).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (x,) = batch
        self.log("v", x.mean(), sync_dist=True)
        self.log("v_local", x.mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StopOnOneRank(cardcage.Callback):
    """Rank ``asking`` (only) sets should_stop at the end of epoch 0; at the end of fit every
    rank writes its global_step, current_epoch and the epochs it ended to ``folder``."""

    def __init__(self, folder: str, asking: int = 1):
        self.folder = folder
        self.asking = asking
        self.ended: list[int] = []

    def on_train_epoch_end(self, trainer: Any, pl_module: Any, outputs: Any) -> None:
        self.ended.append(trainer.current_epoch)
        if trainer.global_rank == self.asking and trainer.current_epoch == 0:
            trainer.should_stop = True

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        record = {
            "global_step": trainer.global_step,
            "current_epoch": trainer.current_epoch,
            "ended": self.ended,
        }
        Path(self.folder, f"rank-{trainer.global_rank}.json").write_text(json.dumps(record))
