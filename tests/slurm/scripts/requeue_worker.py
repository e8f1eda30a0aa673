"""One rank of a job that looks like SLURM (the test sets SLURM_* and a fake ``scontrol``).

It trains fast steps (5 ms of sleep: at most 200 steps/s, so that the stop margin of 0.25 s
stays well inside the run), so the ranks' stop agreement races the loop; with
``--signal-step N`` the rank ``--signal-rank`` sends itself the requeue signal at its N-th
step (on the first run only). ``--margin`` overrides ``cardcage.train.stop_step.MARGIN_S`` (0 makes
"late" ranks, and so further agreement rounds, likely). Rank 0 saves the final weights.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage
from cardcage.train import stop_step


class Model(torch.nn.Module):
    def __init__(self, signal_step: int, signal_rank: int, sig: int, step_sleep: float):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )
        self.signal_step, self.signal_rank, self.sig = signal_step, signal_rank, sig
        self.step_sleep = step_sleep
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps += 1
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        first_run = os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
        if first_run and self.steps == self.signal_step and rank == self.signal_rank:
            os.kill(os.getpid(), self.sig)
        time.sleep(self.step_sleep)
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--signal-step", type=int, default=0)
    parser.add_argument("--signal-rank", type=int, default=0)
    parser.add_argument("--signal", default="USR1")
    parser.add_argument("--margin", type=float, default=None)
    parser.add_argument("--step-sleep", type=float, default=0.005)
    parser.add_argument("--root", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", default=None, help="distributed_backend (default: the rules)")
    args = parser.parse_args()
    if args.margin is not None:
        stop_step.MARGIN_S = args.margin
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(args.samples, 4, generator=generator)
    data = TensorDataset(x, (x[:, :1] - x[:, 1:2] * x[:, 2:3]).tanh())
    trainer = cardcage.Trainer(
        num_processes=args.num_processes,
        max_epochs=args.epochs,
        default_root_dir=args.root,
        distributed_backend=args.backend,
    )
    sig = signal.Signals[f"SIG{args.signal}"]
    model = Model(args.signal_step, args.signal_rank, sig, args.step_sleep)
    trainer.fit(model, DataLoader(data, batch_size=4, shuffle=False))
    print(f"worker: finished at global step {trainer.global_step}", flush=True)
    if trainer.accelerator.is_global_zero:
        torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
