"""What tests/slurm/test_submit.py submits: ``train`` trains a small regression with the
hyperparameters of its grid point and returns what SLURM gave this task, what cardcage
selected, what the process group used, and (rank 0) the final weights.

The data is synthetic and not shuffled; each rank takes ``batch_size / world size`` samples
per step, so any number of ranks trains like one process with ``batch_size``
(:func:`plain_loop`, the reference).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from cardcage_submit import current_run


def dataset(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, 8, generator=generator)
    y = (x[:, :1] * 0.5 - x[:, 1:2] + 0.25 * x[:, 2:3] * x[:, 3:4]).tanh()
    return TensorDataset(x, y)


def network(hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
    )


def optimizer_for(parameters: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=lr, momentum=0.9)


class Regression(torch.nn.Module):
    def __init__(self, lr: float, hidden: int, step_sleep: float, marker: str | None, at: int):
        super().__init__()
        self.net = network(hidden)
        self.lr = lr
        self.step_sleep = step_sleep
        self.marker = marker
        self.marker_step = at
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.steps += 1
        if self.marker and self.steps == self.marker_step and not Path(self.marker).exists():
            Path(self.marker).write_text(f"{os.getpid()}\n")  # for tests: "signal me now"
        if self.step_sleep:
            time.sleep(self.step_sleep)
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer_for(self.parameters(), self.lr)


def plain_loop(
    lr: float, hidden: int, samples: int, batch_size: int, epochs: int
) -> dict[str, torch.Tensor]:
    """The reference: one process, a hand-written loop over the same data and model."""
    net = network(hidden)
    optimizer = optimizer_for(net.parameters(), lr)
    loader = DataLoader(dataset(samples), batch_size=batch_size, shuffle=False)
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            optimizer.step()
    return {f"net.{key}": value.detach().clone() for key, value in net.state_dict().items()}


def train(
    lr: float,
    hidden: int,
    samples: int = 256,
    batch_size: int = 32,
    step_sleep: float = 0.0,
    marker: str | None = None,
    marker_step: int = 0,
) -> dict[str, Any]:
    run = current_run()
    assert run is not None, "not inside a job submitted by cardcage"
    trainer = run.trainer()
    selection = trainer.selection
    loader = DataLoader(
        dataset(samples), batch_size=batch_size // selection.world_size, shuffle=False
    )
    model = Regression(lr, hidden, step_sleep, marker, marker_step)
    trainer.fit(model, loader)
    info: dict[str, Any] = {
        "hparams": run.hparams,
        "job_id": run.job_id,
        "restart": run.restart,
        "folder": str(run.folder),
        "slurm": {
            name: os.environ.get(f"SLURM_{name}")
            for name in ("JOB_ID", "NTASKS", "PROCID", "LOCALID", "NODEID", "NODELIST")
        },
        "slurmd_nodename": os.environ.get("SLURMD_NODENAME"),
        "master_port_env": os.environ.get("MASTER_PORT"),
        "selection": {
            name: getattr(selection, name)
            for name in (
                "accelerator",
                "cluster",
                "world_size",
                "global_rank",
                "local_rank",
                "node_rank",
                "master_address",
                "master_port",
                "processes_created_outside",
            )
        },
        "global_step": trainer.global_step,
        "pid": os.getpid(),
    }
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        info["process_group"] = {
            "rank": torch.distributed.get_rank(),
            "world_size": torch.distributed.get_world_size(),
        }
    if trainer.accelerator.is_global_zero:
        weights = {key: value.detach().clone() for key, value in model.state_dict().items()}
        info["weights"] = weights
        torch.save(weights, run.folder / "weights.pt")
    return info
