"""Train a small regression model with cardcage in this one process.

    python examples/plain/train.py
    python examples/plain/train.py --epochs 5 --batch-size 32
    python examples/plain/train.py --gpus 1          # on a machine with a GPU

No backend is named: cardcage's rules pick one (here, with no GPU and one process: ``cpu``,
rule 1000) and the script prints why. At the end it prints one ``cardcage-example:`` line,
JSON with what was selected and the final weights. ``reference()`` is the same training as a
hand-written PyTorch loop: the example's test checks that both end with the same weights.
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
    """One ``cardcage-example:`` line: what was selected and the final weights."""
    selection = trainer.selection
    line = {
        "example": "plain",
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
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"cardcage-example: {json.dumps(line)}\n".encode())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to train on (default: none)")
    args = parser.parse_args()

    trainer = cardcage.Trainer(gpus=args.gpus, max_epochs=args.epochs)
    print(trainer.selection.explain())  # which backend, which rule, and why
    model = Regressor()
    trainer.fit(model, DataLoader(dataset(args.samples), batch_size=args.batch_size))
    report(trainer, model)


if __name__ == "__main__":
    main()
