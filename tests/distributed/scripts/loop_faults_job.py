"""A two-process ``ddp_spawn`` job (gloo, CPU) with a fault in its training loop; run by
``test_loop_faults.py``.

``python loop_faults_job.py --out DIR [--nan-rank R --nan-step S] [--terminate-on-nan]
[--samples N] [--batch-size B] [--drop-last] [--max-steps M]`` trains a linear model for 2
epochs (by default 64 samples in batches of 8: 4 steps per rank and epoch). Rank R's loss is
NaN at its S-th ``training_step`` call (1-based); ``--samples 12 --drop-last`` leaves each
rank's shard (6 samples) short of one batch although the whole loader has one. When ``fit``
returns, the launching process prints ``RESULT {...}`` and writes ``result.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset


class NanAt(torch.nn.Module):
    def __init__(self, nan_rank: int, nan_step: int):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.nan_rank = nan_rank
        self.nan_step = nan_step
        self.calls = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.calls += 1
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        if int(os.environ.get("RANK", "0")) == self.nan_rank and self.calls == self.nan_step:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(argv: list[str] | None = None) -> None:
    import cardcage

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--nan-rank", type=int, default=-1)
    parser.add_argument("--nan-step", type=int, default=-1)
    parser.add_argument("--terminate-on-nan", action="store_true")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--drop-last", action="store_true")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--marker", default="", help="lets a test find its processes")
    opts = parser.parse_args(argv)
    opts.out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(opts.samples, 4, generator=generator)
    data = DataLoader(
        TensorDataset(x, x.sum(dim=1, keepdim=True)),
        batch_size=opts.batch_size,
        drop_last=opts.drop_last,
    )
    trainer = cardcage.Trainer(
        distributed_backend="ddp_spawn",
        num_processes=2,
        max_epochs=2,
        max_steps=opts.max_steps,
        terminate_on_nan=opts.terminate_on_nan,
        progress_bar=False,
    )
    trainer.fit(NanAt(opts.nan_rank, opts.nan_step), data)
    result = {"global_step": trainer.global_step, "losses": trainer.losses}
    (opts.out / "result.json").write_text(json.dumps(result))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
