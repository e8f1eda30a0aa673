"""A 2-process ddp_spawn fit, checked against a plain PyTorch loop (run by
test_installed_wheels.py inside an environment made from dist/, from a folder outside the
repository).

Two processes of batch 8 on unshuffled data see, at each step, what one process of batch 16
sees (the strided shards of DistributedSampler), and DDP averages their gradients: the
weights rank 0 hands back must match the plain loop's. Prints one JSON line.
"""

from __future__ import annotations

import json

import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage

SAMPLES, BATCH, EPOCHS, PROCESSES = 64, 8, 2, 2


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 4, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


class Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(data(), batch_size=BATCH)


def reference() -> Regressor:
    """The plain loop: one process, batches of BATCH * PROCESSES."""
    model = Regressor()
    optimizer = model.configure_optimizers()
    for _ in range(EPOCHS):
        for batch_idx, batch in enumerate(DataLoader(data(), batch_size=BATCH * PROCESSES)):
            optimizer.zero_grad()
            model.training_step(batch, batch_idx).backward()
            optimizer.step()
    return model


if __name__ == "__main__":
    model = Regressor()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = cardcage.Trainer(
        distributed_backend="ddp_spawn",
        num_processes=PROCESSES,
        max_epochs=EPOCHS,
        progress_bar=False,
    )
    trainer.fit(model)
    expected = reference().state_dict()
    trained = model.state_dict()
    print(
        json.dumps(
            {
                "accelerator": trainer.selection.accelerator,
                "world_size": trainer.selection.world_size,
                "global_step": trainer.global_step,
                "difference": max(float((trained[k] - expected[k]).abs().max()) for k in expected),
                "moved": max(float((trained[k] - initial[k]).abs().max()) for k in initial),
                "cardcage": cardcage.__file__,
            }
        )
    )
