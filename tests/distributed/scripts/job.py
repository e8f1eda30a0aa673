"""A small training job the distributed tests (and benchmarks/ddp.py) run in every mode.

Run as a script (``python job.py --out DIR ...``, under torchrun too) it trains a linear
model on 64 indexed samples with cardcage and leaves, per rank:

- ``info-rank<R>.json``, written from inside ``training_step`` (so spawned workers leave it
  too): rank, world size, local rank, pid, torch threads, the sample indices of every epoch,
  the local validation losses;
- ``result-rank<R>.json``, written by every process that ran the script once ``fit``
  returned: the final weights, the selection, the logged metrics, checkpoint bookkeeping;
- ``pid-rank<R>`` at its second step (fault tests kill or signal it then).

Faults a test can inject: a rank that raises (``--fail-rank``/``--fail-step``), spins
(``--spin-rank``/``--spin-step``), leaves with ``os._exit`` (``--leave-rank``/``--leave-step``,
status ``--leave-status``), stops itself with SIGSTOP (``--stop-rank``/``--stop-step``), or
sleeps in ``configure_optimizers`` (``--slow-optimizers-rank``, ``--slow-optimizers-s``).

Imported, it offers :func:`reference_weights`, a plain PyTorch loop to compare against.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

FEATURES = 4
LR = 0.1


class Indexed(Dataset):  # type: ignore[type-arg]
    """``(index, x, y)`` samples of a noisy linear target, the same in every process."""

    def __init__(self, samples: int):
        generator = torch.Generator().manual_seed(1234)
        self.x = torch.randn(samples, FEATURES, generator=generator)
        w = torch.arange(1.0, FEATURES + 1).unsqueeze(1)
        self.y = self.x @ w + 0.1 * torch.randn(samples, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


def make_model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1)


def reference_weights(batch_size: int, epochs: int = 1, samples: int = 64) -> list[float]:
    """Final weights of a plain PyTorch loop over the unshuffled data (one process)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(Indexed(samples), batch_size=batch_size, shuffle=False)
    for _ in range(epochs):
        for _, x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
    return flat_weights(model)


def flat_weights(model: torch.nn.Module) -> list[float]:
    return [float(v) for p in model.parameters() for v in p.detach().reshape(-1)]


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _write_json(path: Path, data: Any) -> None:
    temporary = path.with_suffix(f".tmp{os.getpid()}")
    temporary.write_text(json.dumps(data))
    os.replace(temporary, path)


def _spin(flag: Path) -> None:
    """Hang the way a bug does: spin on the CPU forever, holding the GIL."""
    flag.write_text(str(time.time()))
    while True:
        pass


class Job(torch.nn.Module):
    """The model: cardcage's contract around a linear layer, with probes and faults."""

    def __init__(self, options: argparse.Namespace):
        super().__init__()
        self.layer = make_model()
        self.out = str(options.out)
        self.fail_rank = options.fail_rank
        self.fail_step = options.fail_step
        self.step_sleep = options.step_sleep
        self.spin_rank = options.spin_rank
        self.spin_step = options.spin_step
        self.leave_rank = options.leave_rank
        self.leave_step = options.leave_step
        self.leave_status = options.leave_status
        self.stop_rank = options.stop_rank
        self.stop_step = options.stop_step
        self.slow_optimizers_rank = options.slow_optimizers_rank
        self.slow_optimizers_s = options.slow_optimizers_s
        self.batch_size = options.batch_size
        self.samples = options.samples
        self.shuffle = options.shuffle
        self.val = options.val
        self.steps = 0
        self.epochs: list[list[int]] = []
        self.val_local: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def to(self, *args: Any, **kwargs: Any) -> Job:
        """The backend places the model in its setup, before any step: ``--stop-step 0``
        stops the rank there, while its peers go on to wait in their first collective."""
        if self.stop_step == 0:
            self._stop()
        return super().to(*args, **kwargs)

    def _stop(self) -> None:
        rank = _rank()
        if rank == self.stop_rank:
            (Path(self.out) / f"stopping-rank{rank}").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)

    def info(self) -> dict[str, Any]:
        import torch.distributed as dist

        return {
            "rank": _rank(),
            "world": dist.get_world_size() if dist.is_initialized() else 1,
            "dist_rank": dist.get_rank() if dist.is_initialized() else 0,
            "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "node_rank": os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK")),
            "pid": os.getpid(),
            "threads": torch.get_num_threads(),
            "omp": os.environ.get("OMP_NUM_THREADS"),
            "epochs": self.epochs,
            "first_index": self.epochs[0][0] if self.epochs and self.epochs[0] else None,
            "val_local": self.val_local,
        }

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        index, x, y = batch
        if batch_idx == 0:
            self.epochs.append([])
        self.epochs[-1].extend(int(i) for i in index)
        self.steps += 1
        rank = _rank()
        _write_json(Path(self.out) / f"info-rank{rank}.json", self.info())
        if self.steps == 2:
            (Path(self.out) / f"pid-rank{rank}").write_text(str(os.getpid()))
        if rank == self.fail_rank and self.steps == self.fail_step:
            raise RuntimeError(f"injected failure at step {self.steps} on rank {rank}")
        if rank == self.spin_rank and self.steps == self.spin_step:
            _spin(Path(self.out) / f"spinning-rank{rank}")
        if rank == self.leave_rank and self.steps == self.leave_step:
            (Path(self.out) / f"leaving-rank{rank}").write_text(str(os.getpid()))
            os._exit(self.leave_status)  # gone mid-fit, without a word
        if self.steps == self.stop_step:
            self._stop()
        if self.step_sleep:
            time.sleep(self.step_sleep)
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.val_local.append(float(loss))
        _write_json(Path(self.out) / f"info-rank{_rank()}.json", self.info())
        return {"loss": loss}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        rank = _rank()
        if rank == self.slow_optimizers_rank:
            (Path(self.out) / f"slow-optimizers-rank{rank}").write_text(str(os.getpid()))
            time.sleep(self.slow_optimizers_s)
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self) -> DataLoader:  # type: ignore[type-arg]
        return DataLoader(Indexed(self.samples), batch_size=self.batch_size, shuffle=self.shuffle)

    def val_dataloader(self) -> DataLoader | None:  # type: ignore[type-arg]
        if not self.val:
            return None
        return DataLoader(Indexed(self.samples), batch_size=self.batch_size)


def options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--backend", default=None, help="distributed_backend; omit for none")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--shuffle", action="store_true")
    parser.add_argument("--no-replace-sampler", action="store_true")
    parser.add_argument("--val", action="store_true")
    parser.add_argument("--progress-bar", action="store_true")
    parser.add_argument("--fit-twice", action="store_true")
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-step", type=int, default=-1)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--spin-rank", type=int, default=-1, help="a rank that hangs...")
    parser.add_argument("--spin-step", type=int, default=-1, help="...spinning at this step")
    parser.add_argument("--leave-rank", type=int, default=-1, help="a rank that exits...")
    parser.add_argument("--leave-step", type=int, default=-1, help="...at this step...")
    parser.add_argument("--leave-status", type=int, default=0, help="...with this status")
    parser.add_argument("--stop-rank", type=int, default=-1, help="a rank that SIGSTOPs...")
    parser.add_argument("--stop-step", type=int, default=-1, help="...at this step (0: setup)")
    parser.add_argument("--slow-optimizers-rank", type=int, default=-1)
    parser.add_argument("--slow-optimizers-s", type=float, default=0.0)
    parser.add_argument("--marker", default="", help="lets a test find its processes")
    return parser.parse_args(argv)


def trainer_for(opts: argparse.Namespace) -> Any:
    import cardcage

    flags: dict[str, Any] = {
        "num_processes": opts.num_processes,
        "num_nodes": opts.num_nodes,
        "max_epochs": opts.epochs,
        "replace_sampler_ddp": not opts.no_replace_sampler,
        "progress_bar": opts.progress_bar,
    }
    if opts.backend:
        flags["distributed_backend"] = opts.backend
    return cardcage.Trainer(**flags)


def main(argv: list[str] | None = None) -> None:
    opts = options(argv)
    opts.out.mkdir(parents=True, exist_ok=True)
    model = Job(opts)
    trainer = trainer_for(opts)
    trainer.fit(model)
    if opts.fit_twice:  # a second Trainer and fit in the same script join the same processes
        trainer = trainer_for(opts)
        trainer.fit(model)
    saves = []
    seen_after_save = None
    if opts.checkpoint is not None:
        from cardcage.checkpoints import io as checkpoint

        original = checkpoint.save_atomic

        def counting(*args: Any, **kwargs: Any) -> Any:
            saves.append(os.getpid())
            return original(*args, **kwargs)

        checkpoint.save_atomic = counting  # type: ignore[assignment]
        if trainer.accelerator.is_global_zero:
            time.sleep(1.0)  # the other ranks must wait for this write
        trainer.save_checkpoint(opts.checkpoint)
        seen_after_save = opts.checkpoint.exists()
    selection = trainer.selection
    result = {
        "rank": _rank(),
        "pid": os.getpid(),
        "accelerator": selection.accelerator,
        "cluster": selection.cluster,
        "rule": selection.rule,
        "trained_by": trainer.accelerator.name,
        "weights": flat_weights(model),
        "logged_metrics": trainer.logged_metrics,
        "global_step": trainer.global_step,
        "progress_bar": bool(trainer.progress.enabled),
        "saves": len(saves),
        "checkpoint_seen_after_save": seen_after_save,
        "threads": torch.get_num_threads(),
    }
    _write_json(opts.out / f"result-rank{result['rank']}.json", result)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
