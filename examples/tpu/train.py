"""Train a small regression model on TPU cores through torch-xla (or on XLA's CPU device).

    python examples/tpu/train.py                        # on a TPU VM: one core
    python examples/tpu/train.py --tpu-cores 8          # every core of the host
    PJRT_DEVICE=CPU python examples/tpu/train.py        # no TPU: XLA's CPU device
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=2 python examples/tpu/train.py --tpu-cores 8

Needs torch-xla for the installed torch (``pip install 'cardcage[tpu]'``; torch-xla 2.9 needs
torch 2.9) and ``cardcage-tpu``. ``tpu_cores`` selects the ``tpu`` backend (rule 200):

- ``1``: one core, trained in this process; the model stays on the XLA device.
- ``8``: every core of the host (on the CPU device, ``CPU_NUM_DEVICES`` of them): torch-xla's
  ``xmp.spawn`` starts a replica per device, each training on its share of the data with the
  gradients averaged; rank 0's weights come back into ``model`` here, on the CPU. ``xmp.spawn``
  needs a process that has not used XLA yet, and re-imports this script: keep the training
  under ``if __name__ == "__main__":``.
- ``"k,"``: core k alone, in this process.

At the end the script prints one ``cardcage-example:`` line, JSON with what was selected and
the final weights. The data is not shuffled, with ``--batch-size`` samples per replica per
step, so N replicas train exactly like one process on batches N times larger, which
``reference()`` computes with a hand-written PyTorch loop on the CPU.
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
        "example": "tpu",
        "pid": os.getpid(),
        "accelerator": selection.accelerator,
        "cluster": selection.cluster,
        "rule": selection.rule,
        "tpu_cores": selection.tpu_cores,
        "rank": selection.global_rank,
        "global_step": trainer.global_step,
        "loss": trainer.logged_metrics.get("loss"),
        "device": str(next(model.parameters()).device),
        "weights": {k: v.detach().cpu().tolist() for k, v in model.state_dict().items()},
    }
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"cardcage-example: {json.dumps(line)}\n".encode())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tpu-cores", default="1", help="1, 8 (every core) or 'k,' (core k)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8, help="samples per replica per step")
    args = parser.parse_args()

    trainer = cardcage.Trainer(tpu_cores=args.tpu_cores, max_epochs=args.epochs)
    print(trainer.selection.explain().splitlines()[0])
    model = Regressor()
    # Unshuffled; with several replicas cardcage gives the loader a DistributedSampler.
    trainer.fit(model, DataLoader(dataset(args.samples), batch_size=args.batch_size))
    report(trainer, model)


if __name__ == "__main__":
    main()
