"""A ddp job for test_accumulation.py: ``python accumulation_job.py OUT [ACCUMULATE]``.

Two processes by script relaunch train the kit's model with ``accumulate_grad_batches``.
Each rank wraps DistributedDataParallel's all-reduce in a comm hook that counts the
backward passes that synchronized (the last bucket of each), counts every backward pass
(a hook on a parameter), and writes both with its global step to ``OUT/rank<R>.json``.
"""

import json
import sys
from collections.abc import Generator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import cardcage
from cardcage import sdk
from cardcage.testing.models import SAMPLES, KitModel, loader


class Counter:
    """Counts the backward passes of this process, and those that all-reduced gradients."""

    def __init__(self, out: Path):
        self.out = out
        self.backwards = 0
        self.synchronized = 0

    # Real annotations (no ``from __future__ import annotations``): DDP checks them.
    def allreduce(
        self,
        state: Any,
        bucket: dist.GradBucket,  # type: ignore[name-defined]
    ) -> torch.futures.Future[torch.Tensor]:
        if bucket.is_last():
            self.synchronized += 1
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

    def backward(self, grad: torch.Tensor) -> None:
        self.backwards += 1

    @sdk.hookimpl(wrapper=True)
    def cardcage_setup_process(self, trainer: Any, accelerator: Any) -> Generator[None, Any, Any]:
        result = yield
        accelerator.parallel.register_comm_hook(None, self.allreduce)
        next(iter(accelerator.unwrapped_model(trainer).parameters())).register_hook(self.backward)
        return result

    @sdk.hookimpl(wrapper=True)
    def cardcage_teardown_process(
        self, trainer: Any, accelerator: Any
    ) -> Generator[None, Any, Any]:
        counts = {
            "backwards": self.backwards,
            "synchronized": self.synchronized,
            "global_step": trainer.global_step,
        }
        (self.out / f"rank{accelerator.global_rank}.json").write_text(json.dumps(counts))
        return (yield)


def main(out: Path, accumulate: int) -> None:
    sdk.register_plugin(Counter(out), name="accumulation-counter")
    trainer = cardcage.Trainer(
        distributed_backend="ddp",
        num_processes=2,
        max_epochs=2,
        accumulate_grad_batches=accumulate,
        progress_bar=False,
    )
    trainer.fit(KitModel("sgd"), loader(SAMPLES, 4))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 3)
