"""A 2-process job whose ranks pause at their third step until told to go on:
``python pause_job.py OUT BACKEND``.

Each rank writes ``OUT/paused-RANK`` and waits (60 s at most) for ``OUT/go``, so that a test
can look at the running job: its processes, its sockets.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage


class Net(torch.nn.Module):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.out = Path(out)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 2:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            (self.out / f"paused-{rank}").touch()
            deadline = time.monotonic() + 60
            while not (self.out / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    out, backend = sys.argv[1], sys.argv[2]
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    trainer = cardcage.Trainer(
        distributed_backend=backend, num_processes=2, max_epochs=1, progress_bar=False
    )
    trainer.fit(Net(out), DataLoader(data, batch_size=8))
