"""A ddp2 job for test_accumulation.py: ``python accumulation_job.py OUT``.

Two nodes of one CPU process each (NODE_RANK 0 and 1, started by the test) train the kit's
model with ``accumulate_grad_batches=3``. At the start of each training step but the first of
an optimizer step, each rank compares its gradients with their mean over the ranks (one
all-reduce): equal only if the previous micro-batch's backward already averaged them. It
appends what it saw to ``OUT/rank<R>.jsonl``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

import cardcage
from cardcage.testing import models
from cardcage.testing.models import SAMPLES, KitModel, loader

ACCUMULATE = 3


class Watched(KitModel):
    def __init__(self, out: str):
        super().__init__("sgd")
        self.out = out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        trainer = models.current.trainer
        if batch_idx % ACCUMULATE:
            grads = torch.cat([p.grad.reshape(-1) for p in self.parameters() if p.grad is not None])
            mean = trainer.accelerator.reduce(grads.clone(), "mean")
            path = Path(self.out) / f"rank{trainer.global_rank}.jsonl"
            with path.open("a") as stream:
                stream.write(json.dumps(bool(torch.equal(grads, mean))) + "\n")
        return super().training_step(batch, batch_idx)


def main(out: Path) -> None:
    trainer = cardcage.Trainer(
        distributed_backend="ddp2",
        num_nodes=2,
        max_epochs=2,
        accumulate_grad_batches=ACCUMULATE,
        progress_bar=False,
    )
    trainer.fit(Watched(str(out)), loader(SAMPLES, 4))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
