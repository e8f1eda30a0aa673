"""``cardcage demo``: a small built-in model on built-in synthetic data, on whatever backend
the rules pick. No download; a few seconds on a laptop CPU."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset


def synthetic_data(samples: int, seed: int) -> TensorDataset:
    """Two interleaved spirals in 2-D, labelled 0 and 1, with a little noise."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (samples,), generator=generator)
    radius = torch.rand(samples, generator=generator) * 3 + 0.3
    angle = radius * 2.5 + labels * torch.pi
    points = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    points += 0.05 * torch.randn(points.shape, generator=generator)
    return TensorDataset(points, labels)


class DemoModel(torch.nn.Module):
    """An MLP classifier that follows cardcage's model contract."""

    def __init__(self, width: int = 64, batch_size: int = 64, samples: int = 2048):
        super().__init__()
        self.batch_size = batch_size
        self.samples = samples
        self.net = torch.nn.Sequential(
            torch.nn.Linear(2, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss: torch.Tensor = torch.nn.functional.cross_entropy(self(x), y)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        logits = self(x)
        return {
            "loss": torch.nn.functional.cross_entropy(logits, y),
            "acc": (logits.argmax(dim=1) == y).float().mean(),
        }

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(synthetic_data(self.samples, 0), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(synthetic_data(1024, 1), batch_size=256)


def run(flags: dict[str, Any], progress_bar: bool | None = True) -> int:
    """Train the demo model with ``flags``; print the selection first and the result last."""
    from cardcage.train.trainer import Trainer

    max_epochs = flags.pop("max_epochs", None) or 3
    trainer = Trainer(max_epochs=max_epochs, progress_bar=progress_bar, **flags)
    selection = trainer.selection
    print(
        f"cardcage: training on {selection.accelerator!r} ({selection.rule}: {selection.why}); "
        f"cluster {selection.cluster}, world size {selection.world_size}",
        flush=True,
    )
    for warning in selection.warnings:
        print(f"cardcage: warning: {warning}", flush=True)
    torch.manual_seed(0)
    model = DemoModel()
    start = time.perf_counter()
    trainer.fit(model)
    elapsed = time.perf_counter() - start
    if trainer.accelerator.is_global_zero:
        metrics = ", ".join(
            f"{k} {v:.4f}" for k, v in sorted(trainer.logged_metrics.items()) if k != "epoch"
        )
        print(
            f"cardcage: trained {max_epochs} epoch(s), {trainer.global_step} steps in "
            f"{elapsed:.1f}s: {metrics}",
            flush=True,
        )
    return 0
