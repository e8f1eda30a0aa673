"""Train a small regression model with Horovod, started by horovodrun or by cardcage itself.

    horovodrun --gloo -np 2 -H localhost:2 python examples/horovod/train.py
    python examples/horovod/train.py --num-processes 2      # cardcage starts the 2 workers

Every process trains on its share of the (unshuffled) data with batches of ``--batch-size``,
so two processes of batch 8 train like one process of batch 16. By default the learning rate
is multiplied by the number of processes, as Lightning 1.0 did; ``--no-scale-lr`` (the same
as ``CARDCAGE_HOROVOD_SCALE_LR=0``) keeps it.

``--reference --processes N`` trains the same model in a plain PyTorch loop, in one process,
on batches N times larger (at N times the learning rate unless ``--no-scale-lr``): the run
the Horovod job must match. ``--out PATH`` writes the final weights (rank 0), ``--clip X``
clips the gradient norm to X in ``on_after_backward``. At the end rank 0 prints one
``cardcage-example:`` line, JSON with what was selected and the final weights, as the other
examples do.
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

SAMPLES, FEATURES, HIDDEN = 256, 8, 16


def dataset(samples: int = SAMPLES, seed: int = 0) -> TensorDataset:
    """``y = tanh(x w) + noise`` for one fixed ``w``; ``seed`` draws the samples."""
    w = torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(1234))
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=generator)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(x, y)


class Regressor(torch.nn.Module):
    """A two-layer MLP that follows cardcage's model contract."""

    def __init__(self, lr: float = 0.05, batch_size: int = 8, clip: float | None = None):
        super().__init__()
        torch.manual_seed(0)  # the same initial weights in every process and in the reference
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1)
        )
        self.lr, self.batch_size, self.clip = lr, batch_size, clip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.training_step(batch, batch_idx)

    def on_after_backward(self) -> None:
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.parameters(), self.clip)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(dataset(), batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(dataset(64, seed=1), batch_size=self.batch_size, shuffle=False)


def reference(args: argparse.Namespace) -> torch.nn.Module:
    """The plain PyTorch loop a Horovod job of ``args.processes`` processes must match."""
    scale = 1 if args.no_scale_lr else args.processes
    model = Regressor(args.lr * scale, args.batch_size * args.processes, args.clip)
    optimizer = model.configure_optimizers()
    for _ in range(args.epochs):
        for batch_idx, batch in enumerate(model.train_dataloader()):
            optimizer.zero_grad()
            model.training_step(batch, batch_idx).backward()
            model.on_after_backward()
            optimizer.step()
    return model


def report(trainer: cardcage.Trainer, model: torch.nn.Module) -> None:
    """One ``cardcage-example:`` line: what was selected and the final weights."""
    selection = trainer.selection
    line = {
        "example": "horovod",
        "pid": os.getpid(),
        "accelerator": selection.accelerator,
        "cluster": selection.cluster,
        "rule": selection.rule,
        "world_size": trainer.accelerator.world_size,
        "rank": trainer.accelerator.global_rank,
        "global_step": trainer.global_step,
        "loss": trainer.logged_metrics.get("loss"),
        "weights": {k: v.detach().cpu().tolist() for k, v in model.state_dict().items()},
    }
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"cardcage-example: {json.dumps(line)}\n".encode())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-processes", type=int, default=1, help="workers without horovodrun")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--clip", type=float, default=None, help="max gradient norm")
    parser.add_argument("--no-scale-lr", action="store_true", help="CARDCAGE_HOROVOD_SCALE_LR=0")
    parser.add_argument("--out", help="where rank 0 writes the final weights")
    parser.add_argument("--reference", action="store_true", help="the plain loop instead")
    parser.add_argument("--processes", type=int, default=2, help="for --reference")
    args = parser.parse_args()

    if args.reference:
        model = reference(args)
        rank0 = True
    else:
        if args.no_scale_lr:
            os.environ["CARDCAGE_HOROVOD_SCALE_LR"] = "0"
        model = Regressor(args.lr, args.batch_size, args.clip)
        trainer = cardcage.Trainer(
            distributed_backend="horovod",
            num_processes=args.num_processes,
            max_epochs=args.epochs,
            progress_bar=False,
        )
        trainer.fit(model)
        rank0 = trainer.accelerator.is_global_zero
        if rank0:
            metrics = ", ".join(f"{k} {v:.6f}" for k, v in sorted(trainer.logged_metrics.items()))
            print(f"horovod: {trainer.accelerator.world_size} process(es); {metrics}")
            report(trainer, model)
    if rank0:
        total = sum(float(p.detach().double().sum()) for p in model.parameters())
        print(f"sum of the final weights: {total:.8f}")
        if args.out:
            torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
