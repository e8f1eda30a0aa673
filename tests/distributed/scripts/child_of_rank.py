"""``python child_of_rank.py OUT BACKEND``: a 2-process fit whose callback, in each rank,
starts a plain Python subprocess that asks cardcage what it would select.

Each rank writes ``OUT/rank-<R>.json``: its own world size, and what the child printed (the
child inherits the rank's RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK...).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage

ASK = "import cardcage; print(cardcage.select().accelerator, cardcage.select().world_size)"


class AskAChild(cardcage.Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        child = subprocess.run(
            [sys.executable, "-c", ASK], capture_output=True, text=True, timeout=120
        )
        rank = trainer.global_rank
        Path(self.out, f"rank-{rank}.json").write_text(
            json.dumps(
                {
                    "world_size": trainer.world_size,
                    "rank_variables": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")},
                    "child": child.stdout.strip(),
                    "child_stderr": child.stderr[-2000:],
                    "child_status": child.returncode,
                }
            )
        )


class Net(cardcage.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    out, backend = sys.argv[1:3]
    Path(out).mkdir(parents=True, exist_ok=True)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    trainer = cardcage.Trainer(
        distributed_backend=backend,
        num_processes=2,
        max_epochs=1,
        progress_bar=False,
        logger=False,
        callbacks=[AskAChild(out)],
    )
    trainer.fit(Net(), DataLoader(TensorDataset(x, x[:, :1]), batch_size=4))


if __name__ == "__main__":
    main()
