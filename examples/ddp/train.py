"""Train a small regression model with DistributedDataParallel: cardcage re-runs this script.

    python examples/ddp/train.py                       # 2 CPU processes
    python examples/ddp/train.py --num-processes 4 --epochs 3
    python examples/ddp/train.py --gpus 2              # one process per GPU

``Trainer(distributed_backend="ddp", num_processes=2)``: the process you start trains as rank
0 and starts rank 1 by running ``python examples/ddp/train.py ARGS`` again, with ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set (Lightning 1.0's script
relaunch). Everything in ``main()`` therefore runs in every process; keep it under
``if __name__ == "__main__":``. If a rank fails, the others are stopped and ``fit`` raises.

Every process prints one ``cardcage-example:`` line, JSON with its rank, what was selected and
its final weights (DDP keeps them identical). The data is not shuffled and each process gets
every N-th sample, batches of ``--batch-size``: N processes train exactly like one process on
batches N times larger, which ``reference()`` computes with a hand-written PyTorch loop.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage


def dataset(samples: int) -> TensorDataset:
    """Synthetic data from a seeded generator: the same samples in every process and run."""
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, 8, generator=generator)
    y = (x[:, :1] * 0.5 - x[:, 1:2] + 0.25 * x[:, 2:3] * x[:, 3:4]).tanh()
    return TensorDataset(x, y)


class Regressor(torch.nn.Module):
    """A two-layer MLP with cardcage's model contract: training_step, configure_optimizers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights here and in the reference
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def reference(batch_size: int, epochs: int, samples: int) -> dict[str, torch.Tensor]:
    """The same training as a plain PyTorch loop, in one process."""
    model = Regressor()
    optimizer = model.configure_optimizers()
    for _ in range(epochs):
        for batch_idx, batch in enumerate(DataLoader(dataset(samples), batch_size=batch_size)):
            optimizer.zero_grad()
            model.training_step(batch, batch_idx).backward()
            optimizer.step()
    return model.state_dict()


def report(trainer: cardcage.Trainer, model: torch.nn.Module) -> None:
    """One ``cardcage-example:`` line per process: what was selected and the final weights."""
    selection = trainer.selection
    line = {
        "example": "ddp",
        "pid": os.getpid(),
        "accelerator": selection.accelerator,
        "cluster": selection.cluster,
        "rule": selection.rule,
        "world_size": selection.world_size,
        "rank": selection.global_rank,
        "global_step": trainer.global_step,
        "loss": trainer.logged_metrics.get("loss"),
        "weights": {k: v.detach().cpu().tolist() for k, v in model.state_dict().items()},
    }
    # One write: the processes share this stdout, and a single write never interleaves.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"cardcage-example: {json.dumps(line)}\n".encode())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-processes", type=int, default=2, help="CPU processes")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs: one process each")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8, help="samples per process per step")
    args = parser.parse_args()

    trainer = cardcage.Trainer(
        distributed_backend="ddp",
        num_processes=args.num_processes,
        gpus=args.gpus,
        max_epochs=args.epochs,
    )
    if trainer.selection.global_rank == 0:  # the process you started, before the relaunch
        print(trainer.selection.explain().splitlines()[0])
    model = Regressor()
    # Unshuffled; cardcage gives the loader a DistributedSampler (every N-th sample per rank).
    trainer.fit(model, DataLoader(dataset(args.samples), batch_size=args.batch_size))
    report(trainer, model)


if __name__ == "__main__":
    main()
