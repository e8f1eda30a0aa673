"""An fsdp job for test_accumulation.py: ``python accumulation_job.py OUT [ACCUMULATE]``.

Two processes by script relaunch train the kit's model with ``accumulate_grad_batches``.
At the start of each training step but the first of an optimizer step, each rank records
whether the previous micro-batch's backward left sharded gradients, which only a
reduce-scatter makes (the loop set them to None before the first micro-batch), and writes
what it saw to ``OUT/rank<R>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

import cardcage
from cardcage.testing.models import SAMPLES, KitModel, loader

ACCUMULATE = int(sys.argv[2]) if len(sys.argv) > 2 else 3
#: Per micro-batch after the first of a step: whether sharded gradients were there.
SEEN: list[bool] = []


class Watched(KitModel):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        # self is the sharded copy here; records go to the module, not to the instance.
        if batch_idx % ACCUMULATE:
            SEEN.append(any(p.grad is not None for p in self.parameters()))
        return super().training_step(batch, batch_idx)


def main(out: Path) -> None:
    trainer = cardcage.Trainer(
        distributed_backend="fsdp",
        num_processes=2,
        max_epochs=2,
        accumulate_grad_batches=ACCUMULATE,
        progress_bar=False,
    )
    trainer.fit(Watched("sgd"), loader(SAMPLES, 4))
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(SEEN))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
