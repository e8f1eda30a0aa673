"""Train a small model with cardcage under SLURM: one SLURM task per training process.

    sbatch examples/slurm/submit.sbatch                  # 2 nodes x 2 tasks, requeue on USR1
    srun -N2 --ntasks-per-node=2 python examples/slurm/train.py

SLURM starts the processes (``--ntasks-per-node`` = processes per node: the GPUs of a node, or
CPU processes as here). cardcage sees that ``SLURM_NTASKS`` equals ``num_nodes`` x processes
per node, takes each task's ranks from ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NODEID``,
and rendezvouses at the first host of ``SLURM_NODELIST`` on port 15000 + the last four digits
of ``SLURM_JOB_ID``. Each task prints one ``cardcage-example:`` line with what it used.

Sent ``SIGUSR1`` (``#SBATCH --signal=USR1@90``, or ``scancel --signal=USR1 JOB``), the job
checkpoints at a step all ranks agree on, requeues itself and resumes from that checkpoint
when it starts again: see docs/slurm.md.

The data is synthetic and not shuffled, with ``--batch-size`` samples per rank per step, so
4 ranks with batch 8 train exactly like one process with batch 32 (:func:`plain_loop`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage


def dataset(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, 8, generator=generator)
    y = (x[:, :1] * 0.5 - x[:, 1:2] + 0.25 * x[:, 2:3] * x[:, 3:4]).tanh()
    return TensorDataset(x, y)


def network() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def optimizer_for(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.05, momentum=0.9)


def _rank() -> int:
    distributed = torch.distributed
    return distributed.get_rank() if distributed.is_initialized() else 0


class Regression(torch.nn.Module):
    """The cardcage model: ``training_step`` and ``configure_optimizers`` around a network."""

    def __init__(self, step_sleep: float = 0.0, marker: str | None = None, marker_step: int = 0):
        super().__init__()
        self.net = network()
        self.step_sleep = step_sleep
        self.marker = marker
        self.marker_step = marker_step
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.steps += 1
        if self.marker and self.steps == self.marker_step and _rank() == 0:
            Path(self.marker).write_text(f"{os.getpid()}\n")  # for tests: "signal me now"
        if self.step_sleep:
            time.sleep(self.step_sleep)  # stands in for real work, so a job runs a while
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer_for(self.parameters())


def plain_loop(samples: int, batch_size: int, epochs: int) -> dict[str, torch.Tensor]:
    """The reference: one process, a hand-written loop over the same data and model."""
    net = network()
    optimizer = optimizer_for(net.parameters())
    loader = DataLoader(dataset(samples), batch_size=batch_size, shuffle=False)
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            optimizer.step()
    return {f"net.{key}": value for key, value in net.state_dict().items()}


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else default


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-nodes", type=int, default=_env_int("SLURM_JOB_NUM_NODES", 1))
    parser.add_argument(
        "--num-processes",
        type=int,
        default=_env_int("SLURM_NTASKS_PER_NODE", 1),
        help="CPU processes per node (default: SLURM_NTASKS_PER_NODE)",
    )
    parser.add_argument("--gpus", type=int, default=None, help="GPUs per node (GPU cluster)")
    parser.add_argument(
        "--backend", default="ddp", help="distributed_backend; 'auto' names none (rules pick)"
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--root", default=None, help="default_root_dir (requeue checkpoint)")
    parser.add_argument("--out", default=None, help="rank 0 saves the final weights here")
    parser.add_argument("--marker", default=None, help="rank 0 writes this file at --marker-step")
    parser.add_argument("--marker-step", type=int, default=0)
    parser.add_argument("--tag", default="", help="a label on every report line")
    return parser.parse_args(argv)


def report(trainer: cardcage.Trainer, args: argparse.Namespace) -> dict[str, Any]:
    """What this process was told (SLURM, the selection) and what it used (the process group)."""
    selection = trainer.selection
    info: dict[str, Any] = {
        "tag": args.tag,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm": {
            name: os.environ.get(f"SLURM_{name}")
            for name in (
                "JOB_ID",
                "JOB_NAME",
                "NTASKS",
                "PROCID",
                "LOCALID",
                "NODEID",
                "NODELIST",
                "RESTART_COUNT",
            )
        },
        "slurmd_nodename": os.environ.get("SLURMD_NODENAME"),
        "selection": {
            name: getattr(selection, name)
            for name in (
                "accelerator",
                "cluster",
                "rule",
                "world_size",
                "global_rank",
                "local_rank",
                "node_rank",
                "master_address",
                "master_port",
                "processes_created_outside",
            )
        },
        "global_step": trainer.global_step,
    }
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        store: Any = torch.distributed.distributed_c10d._get_default_store()
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        info["process_group"] = {
            "rank": torch.distributed.get_rank(),
            "world_size": torch.distributed.get_world_size(),
            "store_host": getattr(store, "host", None),
            "store_port": getattr(store, "port", None),
            "MASTER_ADDR": os.environ.get("MASTER_ADDR"),
            "MASTER_PORT": os.environ.get("MASTER_PORT"),
        }
    return info


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    backend = None if args.backend in ("auto", "none", "") else args.backend
    trainer = cardcage.Trainer(
        gpus=args.gpus,
        num_nodes=args.num_nodes,
        num_processes=args.num_processes,
        distributed_backend=backend,
        max_epochs=args.epochs,
        default_root_dir=args.root,
    )
    model = Regression(args.step_sleep, args.marker, args.marker_step)
    loader = DataLoader(dataset(args.samples), batch_size=args.batch_size, shuffle=False)
    trainer.fit(model, loader)
    # One write: processes that share the task's stdout (a relaunch) never interleave a line.
    sys.stdout.flush()
    os.write(
        sys.stdout.fileno(), f"cardcage-example: {json.dumps(report(trainer, args))}\n".encode()
    )
    if trainer.accelerator.is_global_zero and args.out:
        torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
