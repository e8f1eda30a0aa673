"""Two-process CPU FSDP2: cardcage's fsdp against a hand-written FSDP2 loop and cardcage's ddp.

Usage::

    python benchmarks/fsdp.py                 # 3 rounds x 12 steps, a 50M-parameter MLP, Adam
    python benchmarks/fsdp.py --quick         # 2 rounds x 6 steps of a 12M-parameter MLP
    python benchmarks/fsdp.py --rounds 5 --layers 12 --width 2048 --json fsdp.json

Variants, each training the same MLP (``--layers`` square Linear layers of ``--width`` with
ReLU between them, about 50M parameters by default) with Adam on the same data, in two CPU
processes over gloo with one torch thread each:

* ``plain fsdp2``: a hand-written loop: ``init_process_group("gloo")``, ``fully_shard`` on
  every Linear and then the root, Adam on the sharded parameters, a ``DistributedSampler``;
  workers started by ``torch.multiprocessing.spawn``;
* ``cardcage fsdp``: ``cardcage.Trainer(distributed_backend="fsdp", num_processes=2)``
  (script relaunch), with ``fsdp_modules = {Linear}`` (the same sharding);
* ``cardcage ddp``: ``distributed_backend="ddp"`` (DistributedDataParallel), the same model.

Each round runs every variant once, in a shuffled order (load from other processes hits all
alike). Per variant, rank 0 reports:

* ``step``: the median time per step after the first two (start of one ``training_step`` to
  the start of the next), in the median round; ``ratio`` divides by plain fsdp2's of the
  same round (median over rounds);
* ``model MiB``: what each rank holds for the model after a backward, the bytes of its
  parameters, their gradients and the optimizer state (local shards for FSDP), and its ratio
  to ``cardcage ddp``'s; target: at most 0.6 with two ranks (the limit is 0.5);
* ``peak RSS MiB``: the rank's ``ru_maxrss`` at exit (the whole process: torch's imports,
  gloo's buffers, DDP's gradient buckets).

Target: cardcage fsdp's step time at most 1.03x plain fsdp2's. Timing is never a test.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

VARIANTS = ("plain fsdp2", "cardcage fsdp", "cardcage ddp")
BATCH = 8  # per process


class MLP(torch.nn.Module):
    """The benchmark's model; ``training_step`` marks the time and measures memory."""

    fsdp_modules = {torch.nn.Linear}

    def __init__(self, layers: int, width: int, steps: int):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(
            *[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
        )
        self.steps = steps
        self.marks: list[float] = []
        self.held = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.marks.append(time.perf_counter())
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def on_after_backward(self) -> None:
        if len(self.marks) == 3:  # optimizer state exists from the second step on
            self.held = held_bytes(self, self.optimizer)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.optimizer = torch.optim.Adam(self.parameters(), lr=1e-4)
        return self.optimizer


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's parameters, gradients and optimizer state (local shards)."""
    total = 0
    for p in model.parameters():
        total += local(p).numel() * p.element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * p.grad.element_size()
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += local(value).numel() * value.element_size()
    return total


def data(spec: dict[str, Any]) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    samples = BATCH * 2 * spec["steps"]
    x = torch.randn(samples, spec["width"], generator=g)
    return torch.utils.data.TensorDataset(x, torch.randn(samples, spec["width"], generator=g))


def report(spec: dict[str, Any], rank: int, model: MLP) -> None:
    result = {
        "marks": model.marks,
        "held": model.held,
        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(result))


def plain_worker(rank: int, spec: dict[str, Any]) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = MLP(spec["layers"], spec["width"], spec["steps"])
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            fully_shard(module)
    fully_shard(model)
    optimizer = model.configure_optimizers()
    dataset = data(spec)
    sampler = torch.utils.data.DistributedSampler(dataset, 2, rank, shuffle=False)
    for x, y in torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler):
        optimizer.zero_grad()
        model.marks.append(time.perf_counter())
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        model.on_after_backward()
        optimizer.step()
    report(spec, rank, model)
    dist.destroy_process_group()


def child(variant: str, spec: dict[str, Any]) -> None:
    if variant == "plain fsdp2":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
        torch.multiprocessing.spawn(plain_worker, args=(spec,), nprocs=2)
        return
    import cardcage

    backend = "fsdp" if variant == "cardcage fsdp" else "ddp"
    model = MLP(spec["layers"], spec["width"], spec["steps"])
    trainer = cardcage.Trainer(
        distributed_backend=backend, num_processes=2, max_epochs=1, progress_bar=False
    )
    loader = torch.utils.data.DataLoader(data(spec), batch_size=BATCH)
    trainer.fit(model, loader)
    # The model's records are the training copy's (fsdp trains a sharded copy of it).
    trained = getattr(trainer.accelerator, "sharded", None) or model
    report(spec, int(os.environ.get("RANK", "0")), trained)


def measure(variant: str, spec: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        spec = {**spec, "out": out, "port": 29000 + random.randrange(2000)}
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        command = [sys.executable, __file__, "--variant", variant, "--spec", json.dumps(spec)]
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    marks = ranks[0]["marks"]
    steps = [b - a for a, b in itertools.pairwise(marks[2:])]
    return {
        "step": statistics.median(steps),
        "held": max(r["held"] for r in ranks),
        "rss": max(r["rss"] for r in ranks),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds x 6 steps, 12M params")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 12)")
    parser.add_argument("--layers", type=int, default=None, help="default 12")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0, help="order of the variants")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.variant:
        child(args.variant, json.loads(args.spec))
        return 0
    rounds = args.rounds or (2 if args.quick else 3)
    spec = {
        "steps": args.steps or (6 if args.quick else 12),
        "layers": args.layers or (3 if args.quick else 12),
        "width": args.width,
    }
    params = spec["layers"] * (spec["width"] ** 2 + spec["width"])
    print(
        f"fsdp: {rounds} rounds x {spec['steps']} steps, {params / 1e6:.1f}M parameters, Adam, "
        f"2 CPU processes, batch {BATCH} each; torch {torch.__version__}",
        flush=True,
    )
    order = random.Random(args.seed)
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for index in range(rounds):
        variants = list(VARIANTS)
        order.shuffle(variants)
        for variant in variants:
            results[variant].append(measure(variant, spec))
        print(f"  round {index + 1}/{rounds} done", flush=True)
    mib = 1024 * 1024
    ddp_held = statistics.median(r["held"] for r in results["cardcage ddp"])
    rows = []
    print(
        f"\n{'variant':<15}{'step s':>9}{'ratio':>8}{'model MiB':>11}{'vs ddp':>8}"
        f"{'peak RSS MiB':>14}"
    )
    for variant in VARIANTS:
        runs = results[variant]
        ratios = [r["step"] / p["step"] for r, p in zip(runs, results["plain fsdp2"], strict=True)]
        row = {
            "variant": variant,
            "step_s": statistics.median(r["step"] for r in runs),
            "ratio": statistics.median(ratios),
            "model_mib": statistics.median(r["held"] for r in runs) / mib,
            "rss_mib": statistics.median(r["rss"] for r in runs) / mib,
        }
        row["vs_ddp"] = row["model_mib"] * mib / ddp_held
        rows.append(row)
        print(
            f"{variant:<15}{row['step_s']:>9.3f}{row['ratio']:>8.3f}{row['model_mib']:>11.1f}"
            f"{row['vs_ddp']:>8.3f}{row['rss_mib']:>14.1f}"
        )
    fsdp = rows[1]
    print(
        f"\ncardcage fsdp: step {fsdp['ratio']:.3f}x plain fsdp2 (target <= 1.03), model memory "
        f"{fsdp['vs_ddp']:.3f}x cardcage ddp's (target <= 0.6)"
    )
    if args.json:
        args.json.write_text(json.dumps({"spec": spec, "rows": rows, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
