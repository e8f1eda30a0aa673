"""A Lightning 1.0-style model on the backend you name: ``cardcage.Module``, ``self.log``,
validation, a per-step scheduler, ``ModelCheckpoint`` and ``EarlyStopping``.

    python examples/lightning_style.py                                   # one CPU process
    python examples/lightning_style.py --distributed-backend ddp_spawn --num-processes 2
    python examples/lightning_style.py --distributed-backend ddp --num-processes 2
    python examples/lightning_style.py --distributed-backend fsdp_spawn --num-processes 2
    torchrun --standalone --nproc-per-node 2 examples/lightning_style.py \\
        --distributed-backend ddp --num-processes 2

The model logs its training loss every step and as an epoch mean (``train_loss_step``,
``train_loss_epoch``), the validation loss as a mean over every rank's samples
(``sync_dist=True``) and, from ``validation_epoch_end``, the mean absolute error. A StepLR
scheduler steps after every optimizer step (``"interval": "step"``); each optimizer step
takes two batches (``accumulate_grad_batches=2``) and clips the gradients' total norm
(``gradient_clip_val``). ``ModelCheckpoint(monitor="val_loss")`` keeps the best epoch's
checkpoint and ``EarlyStopping(monitor="val_loss")`` ends training when the validation loss
stops improving (every rank stops at the same epoch end). The CSV logs and checkpoints go
under ``--default-root-dir``.

With ``ddp`` the script is run again for each further rank, and under torchrun every process
runs it, so the training is under ``if __name__ == "__main__":``. Every process that runs
``main()`` prints one ``cardcage-example:`` line, JSON with its rank, the final weights and the
checkpoint callback's ``best_model_path`` (with the spawn backends, the process you started,
holding rank 0's weights). ``reference()`` trains the same model with a hand-written PyTorch
loop: same initial weights, same batches in the same order, each step the mean of the
per-rank gradients (what DistributedDataParallel computes), the same clipping, scheduler and
stopping rule; tests/test_examples.py checks that both end with the same weights.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import cardcage
from cardcage.callbacks import EarlyStopping, ModelCheckpoint

#: Training settings shared by the Trainer and the reference loop.
ACCUMULATE = 2
CLIP = 0.25
PATIENCE = 2
MIN_DELTA = 2e-3
TRAIN_SAMPLES, VAL_SAMPLES = 208, 64


def dataset(samples: int, seed: int) -> TensorDataset:
    """Synthetic data from a seeded generator: the same samples in every process and run."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 8, generator=generator)
    y = (x[:, :1] * 0.5 - x[:, 1:2] + 0.25 * x[:, 2:3] * x[:, 3:4]).tanh()
    return TensorDataset(x, y)


def train_data() -> TensorDataset:
    return dataset(TRAIN_SAMPLES, 1234)


def val_data() -> TensorDataset:
    return dataset(VAL_SAMPLES, 4321)


class Regressor(cardcage.Module):
    """A two-layer MLP written as a Lightning 1.0 ``LightningModule``."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights here and in the reference
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        )
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        # on_step and on_epoch: logged as train_loss_step and train_loss_epoch
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        prediction = self(x)
        # a mean over every rank's samples, the same on every rank (what callbacks compare)
        self.log("val_loss", torch.nn.functional.mse_loss(prediction, y), sync_dist=True)
        return {"errors": (prediction - y).abs().flatten()}

    def validation_epoch_end(self, outputs: list[dict[str, torch.Tensor]]) -> None:
        errors = torch.cat([output["errors"] for output in outputs])
        # each rank's mean over as many samples, averaged over the ranks
        self.log("val_mae", errors.mean(), sync_dist=True)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.7)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def rank_batches(
    data: TensorDataset, processes: int, batch_size: int
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each step's batches, one per rank, as the Trainer's unshuffled DistributedSampler
    splits ``data`` (every N-th sample per rank, padded to an even share)."""
    per_rank = []
    for rank in range(processes):
        indices: list[int] = list(DistributedSampler(data, processes, rank, shuffle=False))
        per_rank.append([indices[i : i + batch_size] for i in range(0, len(indices), batch_size)])
    return [[data[index] for index in step] for step in zip(*per_rank, strict=True)]


def reference(
    processes: int,
    batch_size: int,
    max_epochs: int,
    accumulate: int = ACCUMULATE,
    clip: float = CLIP,
) -> dict[str, Any]:
    """The same training as a plain PyTorch loop in one process; returns the final weights,
    the optimizer steps and epochs it ran, and the best validation loss and its epoch."""
    model = Regressor()
    configured = model.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    steps = rank_batches(train_data(), processes, batch_size)
    val_steps = rank_batches(val_data(), processes, batch_size)
    best_saved = best_kept = math.inf
    wait = best_epoch = global_step = epoch = 0
    for epoch in range(max_epochs):
        model.train()
        for start in range(0, len(steps), accumulate):
            optimizer.zero_grad()
            for parts in steps[start : start + accumulate]:
                # DDP: each rank's mean loss, gradients averaged over the ranks; each
                # micro-batch's loss divided by accumulate (the epoch's last group too)
                losses = [torch.nn.functional.mse_loss(model(x), y) for x, y in parts]
                torch.autograd.backward(torch.stack(losses).mean() / accumulate)
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            scheduler.step()  # "interval": "step"
            global_step += 1
        model.eval()
        with torch.no_grad():  # the mean over every rank's samples, weighted by batch size
            sizes = [len(x) for parts in val_steps for x, _ in parts]
            means = [
                float(torch.nn.functional.mse_loss(model(x), y))
                for parts in val_steps
                for x, y in parts
            ]
        val_loss = sum(v * n for v, n in zip(means, sizes, strict=True)) / sum(sizes)
        val_loss = float(torch.tensor(val_loss, dtype=torch.float32))
        if val_loss <= best_saved:  # ModelCheckpoint(monitor="val_loss", save_top_k=1)
            best_saved, best_epoch = val_loss, epoch
        if val_loss < best_kept - MIN_DELTA:  # EarlyStopping(min_delta=..., patience=...)
            best_kept, wait = val_loss, 0
        else:
            wait += 1
            if wait >= PATIENCE:
                break
    return {
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "global_step": global_step,
        "epochs": epoch + 1,
        "best_epoch": best_epoch,
        "best_val_loss": best_saved,
    }


def report(trainer: cardcage.Trainer, model: torch.nn.Module) -> None:
    """One ``cardcage-example:`` line: what ran, the final weights and the best checkpoint."""
    selection = trainer.selection
    checkpoint = trainer.checkpoint_callback
    score = checkpoint.best_model_score
    line = {
        "example": "lightning_style",
        "pid": os.getpid(),
        "accelerator": selection.accelerator,
        "world_size": selection.world_size,
        "rank": selection.global_rank,
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "best_model_path": checkpoint.best_model_path,
        "best_model_score": None if score is None else float(score),
        "stopped_epoch": trainer.early_stopping_callback.stopped_epoch,
        "metrics": {k: float(v) for k, v in sorted(trainer.callback_metrics.items())},
        "weights": {k: v.detach().cpu().tolist() for k, v in model.state_dict().items()},
    }
    # One write: the processes share this stdout, and a single write never interleaves.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"cardcage-example: {json.dumps(line)}\n".encode())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--distributed-backend",
        choices=["cpu", "ddp_spawn", "ddp", "fsdp_spawn"],
        default=None,
        help="the backend (default: cardcage's rules pick one)",
    )
    parser.add_argument("--num-processes", type=int, default=1, help="CPU processes")
    parser.add_argument("--max-epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8, help="samples per process per step")
    parser.add_argument("--default-root-dir", default="lightning_style_runs")
    args = parser.parse_args()

    trainer = cardcage.Trainer(
        distributed_backend=args.distributed_backend,
        num_processes=args.num_processes,
        max_epochs=args.max_epochs,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=CLIP,
        default_root_dir=args.default_root_dir,  # CSV logs and checkpoints go here
        callbacks=[
            ModelCheckpoint(monitor="val_loss"),
            EarlyStopping(monitor="val_loss", min_delta=MIN_DELTA, patience=PATIENCE),
        ],
    )
    # Unshuffled: the Trainer gives each loader a DistributedSampler (every N-th sample).
    train_loader = DataLoader(train_data(), batch_size=args.batch_size)
    val_loader = DataLoader(val_data(), batch_size=args.batch_size)
    model = Regressor()
    trainer.fit(model, train_loader, val_loader)
    report(trainer, model)


if __name__ == "__main__":
    main()
