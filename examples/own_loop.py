"""Your own training loop on the backend you name, through ``cardcage.Cage``.

    python examples/own_loop.py                                          # one CPU process
    python examples/own_loop.py --distributed-backend ddp_spawn --num-processes 2
    python examples/own_loop.py --distributed-backend ddp --num-processes 2
    python examples/own_loop.py --distributed-backend fsdp_spawn --num-processes 2
    torchrun --standalone --nproc-per-node 2 examples/own_loop.py \\
        --distributed-backend ddp --num-processes 2

``main(cage, epochs)`` is a plain PyTorch loop with the Cage's calls in it: ``setup`` for the
model and its optimizer, ``setup_dataloaders`` for the loaders (each rank gets every N-th
sample), two micro-batches per optimizer step (the first inside ``no_backward_sync``, so
only the second backward communicates), ``clip_gradients`` before each step, and
``save`` at the end of every epoch. When the checkpoint file exists (a restart after a rank
died, with ``--max-restarts``, or a second run of the script) ``main`` loads it and carries
on from the epoch it records; delete the file to start over. ``main`` returns the mean
squared error of the final model over the whole data set, computed on every rank's share
and summed with ``all_reduce``.

With ``ddp`` the script is run again for each further rank, with the spawn backends it is
imported by each worker, and under torchrun every process runs it, so the training is
under ``if __name__ == "__main__":``. Every process that called ``launch`` prints one
``cardcage-example:`` line, JSON with what was selected and ``main``'s result (rank 0's);
the weights are in the checkpoint file, as the model's own ``state_dict()``:
``torch.load(path, weights_only=True)["model"]``. tests/test_examples.py trains the same
model with a hand-written PyTorch loop and checks that both end with the same weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage

#: Micro-batches per optimizer step, and the gradients' largest total norm.
ACCUMULATE = 2
CLIP = 0.5
SAMPLES = 256


def dataset() -> TensorDataset:
    """Synthetic data from a seeded generator: the same samples in every process and run."""
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, 8, generator=generator)
    y = (x[:, :1] * 0.5 - x[:, 1:2] + 0.25 * x[:, 2:3] * x[:, 3:4]).tanh()
    return TensorDataset(x, y)


class Regressor(torch.nn.Module):
    """A two-layer MLP: a plain ``torch.nn.Module``, nothing of cardcage's in it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights in every process and run
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def main(
    cage: cardcage.Cage,
    epochs: int,
    batch_size: int = 8,
    checkpoint: str = "own_loop.ckpt",
) -> float:
    """Train for ``epochs`` (resuming from ``checkpoint`` if it exists); runs in every
    training process. Returns the final model's mean squared error over the data set."""
    model = Regressor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = cage.setup(model, optimizer)
    # Unshuffled, so that a test can replay the batches; shuffle=True works the same way.
    loader, whole = cage.setup_dataloaders(
        DataLoader(dataset(), batch_size=batch_size),
        DataLoader(dataset(), batch_size=64),
    )

    start = 0
    if os.path.exists(checkpoint):  # every rank reads it: cage.load is collective
        rest = cage.load(checkpoint, {"model": model, "optimizer": optimizer})
        start = rest["epoch"]
        cage.print(f"resuming at epoch {start} (restart {cage.restarts})")

    for epoch in range(start, epochs):
        model.train()
        for index, (x, y) in enumerate(loader):
            # The forward and the backward of every micro-batch but the last run inside
            # no_backward_sync: their gradients add up locally, and the last backward
            # synchronizes the sum. Each loss is divided by the micro-batches per step.
            last = (index + 1) % ACCUMULATE == 0
            with cage.no_backward_sync(model, enabled=not last):
                with cage.autocast():
                    loss = torch.nn.functional.mse_loss(model(x), y) / ACCUMULATE
                cage.backward(loss)
            if last:
                cage.clip_gradients(model, optimizer, max_norm=CLIP)
                optimizer.step()
                optimizer.zero_grad()
        # Every rank calls save; the file holds the full weights and Adam's state.
        cage.save(checkpoint, {"model": model, "optimizer": optimizer, "epoch": epoch + 1})
        cage.print(f"epoch {epoch}: last micro-batch loss {loss.item() * ACCUMULATE:.5f}")

    model.eval()
    with torch.no_grad():  # this rank's share of the data set, then the sums of every rank
        errors = torch.zeros(2, device=cage.device)
        for x, y in whole:
            errors[0] += torch.nn.functional.mse_loss(model(x), y, reduction="sum").float()
            errors[1] += y.numel()
    total = cage.all_reduce(errors, op="sum")
    return float(total[0] / total[1])


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--distributed-backend",
        default=None,
        help="the backend: cpu, ddp_spawn, ddp, fsdp_spawn, ... (default: the rules pick one)",
    )
    parser.add_argument("--num-processes", type=int, default=1, help="CPU processes")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs (default: none)")
    parser.add_argument("--precision", default="32", help="32, 16, bf16 or 64")
    parser.add_argument("--max-restarts", type=int, default=0, help="restarts after a rank dies")
    parser.add_argument("--max-epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="samples per process per batch")
    parser.add_argument("--checkpoint", default="own_loop.ckpt", help="saved every epoch")
    args = parser.parse_args()

    cage = cardcage.Cage(
        distributed_backend=args.distributed_backend,
        num_processes=args.num_processes,
        gpus=args.gpus,
        precision=args.precision,
        max_restarts=args.max_restarts,
    )
    print(cage.explain())  # which backend, which rule, and why
    checkpoint = os.path.abspath(args.checkpoint)  # spawned workers may start elsewhere
    loss = cage.launch(main, args.max_epochs, args.batch_size, checkpoint)
    line = {
        "example": "own_loop",
        "pid": os.getpid(),
        "accelerator": cage.selection.accelerator,
        "world_size": cage.selection.world_size,
        "rank": cage.selection.global_rank,
        "loss": loss,
        "checkpoint": checkpoint,
    }
    # One write: the processes share this stdout, and a single write never interleaves.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"cardcage-example: {json.dumps(line)}\n".encode())


if __name__ == "__main__":
    run()
