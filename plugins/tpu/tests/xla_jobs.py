"""Training jobs on XLA's CPU device that need a fresh process, run by test_xla_multicore.py.

``python xla_jobs.py OUT JOB...`` runs each job in turn and writes ``OUT/<job>.pt`` (the
trained weights and what the job saw) or ``OUT/<job>.error`` (the traceback). Jobs:

- ``multicore``: ``Trainer(tpu_cores=8)`` with ``CPU_NUM_DEVICES`` replicas (threads of the one
  process ``xmp.spawn`` starts on the CPU device). In its first step every replica records its
  rank, device, a broadcast from rank 1, a barrier and a sum over the replicas; in the second
  epoch it saves a checkpoint (rank 0 writes, every replica waits).
- ``core2``: ``Trainer(tpu_cores=[2])`` in this process: core 2 is device ``xla:1``.
- ``core3``: ``Trainer(tpu_cores=[3])`` with two devices: the error naming them.

``multicore`` must come first: ``xmp.spawn`` needs a process that has not used XLA yet. The
plain-CPU reference runs in the test's process, never here (a CPU backward pass before XLA's
runtime starts breaks XLA's backward in that process).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from cardcage import Trainer

SAMPLES, FEATURES, BATCH, EPOCHS = 64, 8, 8, 2


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = torch.randn(SAMPLES, 1, generator=generator)
    return TensorDataset(x, y)


class Net(torch.nn.Module):
    """A small regression model; ``probe`` (a folder) makes it record the collectives."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )
        self.probe: str | None = None
        self.job_trainer: Any = None
        self.steps = 0
        self.nan_at: int | None = None  # the step whose loss turns NaN on rank 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.probe is not None:
            self.record(batch_idx)
        loss = torch.nn.functional.mse_loss(self(x), y)
        if self.steps == self.nan_at and self.job_trainer.accelerator.global_rank == 1:
            loss = loss * torch.nan
        self.steps += 1
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"loss": torch.nn.functional.mse_loss(self(x), y)}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def record(self, batch_idx: int) -> None:
        accelerator = self.job_trainer.accelerator
        rank = accelerator.global_rank
        folder = Path(str(self.probe))
        if self.steps == 0:
            got = accelerator.broadcast({"from": rank, "items": [1, 2, 3]}, src=1)
            accelerator.barrier("probe")
            total = accelerator.reduce(
                torch.tensor(float(rank + 1), device=accelerator.device), "sum"
            )
            mean = accelerator.reduce(torch.tensor(float(rank + 1), device=accelerator.device))
            seen = {
                "rank": rank,
                "local_rank": accelerator.local_rank,
                "world_size": accelerator.world_size,
                "device": str(accelerator.device),
                "broadcast": got,
                "sum": float(total.cpu()),
                "mean": float(mean.cpu()),
            }
            (folder / f"rank-{rank}.json").write_text(json.dumps(seen))
        if self.job_trainer.current_epoch == 1 and batch_idx == 0:
            self.job_trainer.save_checkpoint(folder / "mid.ckpt")


def run(out: Path, job: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    initial = copy.deepcopy(model.state_dict())
    train = DataLoader(dataset(), batch_size=BATCH, shuffle=True)
    if job == "multicore":
        trainer = Trainer(tpu_cores=8, max_epochs=EPOCHS)
        model.probe, model.job_trainer = str(out), trainer
        trainer.fit(model, train, DataLoader(dataset(), batch_size=BATCH))
    elif job == "nan":  # rank 1's loss is NaN at step 3: fit stops, naming it
        trainer = Trainer(tpu_cores=8, max_epochs=EPOCHS, terminate_on_nan=True)
        model.nan_at, model.job_trainer = 3, trainer
        trainer.fit(model, train)
    elif job in ("core2", "core3"):
        trainer = Trainer(tpu_cores=[int(job[-1])], max_epochs=EPOCHS)
        torch.manual_seed(5)
        trainer.fit(model, train)
    else:
        raise SystemExit(f"unknown job {job!r}")
    return {
        "initial": initial,
        "state_dict": {k: v.cpu() for k, v in model.state_dict().items()},
        "device": str(next(model.parameters()).device),
        "accelerator_device": str(trainer.accelerator.device),
        "selection": trainer.selection.as_dict(),
        "global_step": trainer.global_step,
        "logged_metrics": trainer.logged_metrics,
        "steps_here": model.steps,
    }


def main() -> None:
    out = Path(sys.argv[1])
    for job in sys.argv[2:]:
        try:
            torch.save(run(out, job), out / f"{job}.pt")
        except BaseException:
            (out / f"{job}.error").write_text(traceback.format_exc())
    os._exit(0)  # leave at once: XLA's runtime threads need not wind down


if __name__ == "__main__":
    main()
