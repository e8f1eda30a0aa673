"""A dead rank and one restart: cardcage's restart loop against torch's ``elastic_launch``.

Usage::

    python benchmarks/restarts.py              # 5 rounds
    python benchmarks/restarts.py --rounds 9 --json restarts.json

Both variants train the same two-process DDP job (gloo, an MLP, SGD with momentum, 2 epochs of
8 steps per rank, a checkpoint every 2 steps), and in both rank 1 SIGKILLs itself at global
step 13 of 16 on the first attempt:

* ``cardcage``: ``Trainer(distributed_backend="ddp_spawn", num_processes=2, max_restarts=1,
  checkpoint_every_n_steps=2)``: cardcage's supervisor stops rank 0, the launching process
  starts both workers again, and they resume from the last step checkpoint;
* ``elastic``: ``torch.distributed.launcher.api.elastic_launch`` with ``max_restarts=1``
  (``monitor_interval=0.1``, c10d rendezvous on 127.0.0.1) running a hand-written DDP loop
  that saves and resumes its own checkpoint every 2 steps (what a user of elastic writes).

Per round and variant: ``recover`` is the time from the kill to the first step of the
second attempt (detection, stopping the survivors, starting again, rendezvous, loading the
checkpoint); ``wall`` the whole run; ``left`` the processes of the job still alive 3 s after
it returned; ``traceback`` whether what the caller got names rank 1 and its signal. Medians
over rounds. The final weights of both are compared with an uninterrupted run's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from cardcage.testing.harness import leftover_processes

KILL_STEP = 13
STEPS_PER_EPOCH = 8


class Net(torch.nn.Module):
    def __init__(self, out: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
        )
        self.register_buffer("step", torch.zeros((), dtype=torch.long))
        self.out = out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.step += 1
        note(self.out, int(self.step))
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def note(out: str, step: int) -> None:
    """Log the step's time; rank 1 dies at KILL_STEP on the first attempt."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    with open(Path(out, f"steps-{rank}.log"), "a") as log:
        log.write(f"{step} {time.time()}\n")
    killed = Path(out, "killed")
    if rank == 1 and step == KILL_STEP and out.endswith("kill") and not killed.exists():
        killed.write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)


def data() -> Any:
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(128, 16, generator=g), torch.randn(128, 1, generator=g))


# -- cardcage ----------------------------------------------------------------------------------


def run_cardcage(out: str) -> list[float]:
    from torch.utils.data import DataLoader

    import cardcage

    model = Net(out)
    trainer = cardcage.Trainer(
        distributed_backend="ddp_spawn",
        num_processes=2,
        max_epochs=2,
        max_restarts=1,
        checkpoint_every_n_steps=2,
        progress_bar=False,
    )
    trainer.fit(model, DataLoader(data(), batch_size=8))
    return [float(p.detach().sum()) for p in model.parameters()]


# -- torch elastic -----------------------------------------------------------------------------


def elastic_worker(out: str) -> list[float] | None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    # torch's env:// reuses the agent store's keys on a restart: a restarted rank may read a
    # dead rank's address ("Gloo connectFullMesh failed ... Connection refused"; seen here).
    # A key space per attempt, as cardcage does under torchrun.
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"attempt_{attempt}", client)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    model = Net(out)
    parallel = DistributedDataParallel(model.net)
    optimizer = model.configure_optimizers()
    checkpoint = Path(out, "last.pt")
    start = 0
    if checkpoint.exists():
        state = torch.load(checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    sampler = DistributedSampler(data(), shuffle=False)
    loader = DataLoader(data(), batch_size=8, sampler=sampler)
    step = 0
    for _epoch in range(2):
        for x, y in loader:
            step += 1
            if step <= start:
                continue
            optimizer.zero_grad()
            model.step += 1
            note(out, int(model.step))
            torch.nn.functional.mse_loss(parallel(x), y).backward()
            optimizer.step()
            if step % 2 == 0 and dist.get_rank() == 0:
                tmp = checkpoint.with_suffix(".tmp")
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save({**state, "step": step}, tmp)
                os.replace(tmp, checkpoint)
            dist.barrier()
    weights = [float(p.detach().sum()) for p in model.parameters()]
    dist.destroy_process_group()
    return weights if int(os.environ["RANK"]) == 0 else None


def run_elastic(out: str) -> list[float]:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=2,
        run_id=f"restarts-{os.getpid()}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=1,
        monitor_interval=0.1,
    )
    results = elastic_launch(config, elastic_worker)(out)
    weights: list[float] = results[0]
    return weights


# -- the driver --------------------------------------------------------------------------------


def child(variant: str, out: str) -> None:
    run = run_cardcage if variant == "cardcage" else run_elastic
    weights = run(out)
    Path(out, "weights.json").write_text(json.dumps(weights))


def measure(variant: str, kill: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cardcage-restarts-") as folder:
        out = os.path.join(folder, "kill" if kill else "straight")
        os.mkdir(out)
        marker = os.path.basename(folder)
        env = {**os.environ, "CARDCAGE_RESTARTS_MARKER": marker, "OMP_NUM_THREADS": "1"}
        began = time.time()
        done = subprocess.run(
            [sys.executable, __file__, "--child", variant, out],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        wall = time.time() - began
        time.sleep(3)
        left = len(leftover_processes(marker))
        weights = None
        if (Path(out) / "weights.json").exists():
            weights = json.loads((Path(out) / "weights.json").read_text())
        recover = None
        if kill and (Path(out) / "killed").exists():
            killed = float((Path(out) / "killed").read_text())
            lines = (Path(out) / "steps-0.log").read_text().split("\n")
            again = [float(t) for s, t in (x.split() for x in lines if x) if int(s) == KILL_STEP]
            # The second attempt resumes at step 12's checkpoint: its step 13 is the last.
            recover = max(again) - killed if again and max(again) > killed else None
        return {
            "returncode": done.returncode,
            "wall_s": wall,
            "recover_s": recover,
            "left": left,
            "weights": weights,
            "output": (done.stdout + done.stderr)[-2000:],
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    reference = measure("cardcage", kill=False)["weights"]
    rows: dict[str, list[dict[str, Any]]] = {"cardcage": [], "elastic": []}
    for index in range(args.rounds):
        for variant in rows if index % 2 == 0 else reversed(list(rows)):
            result = measure(variant, kill=True)
            rows[variant].append(result)
            if result["returncode"] != 0:
                print(f"{variant} round {index + 1} exited {result['returncode']}")
                print(result["output"])
        print(f"round {index + 1}/{args.rounds} done", flush=True)
    print("| variant | runs ok | recover s (median) | wall s (median) | left | max dw |")
    print("|---|---:|---:|---:|---:|---:|")
    for variant, results in rows.items():
        ok = [r for r in results if r["returncode"] == 0]
        recover = [r["recover_s"] for r in ok if r["recover_s"] is not None]
        dw = max(
            (
                abs(a - b)
                for r in ok
                if r["weights"]
                for a, b in zip(r["weights"], reference, strict=True)
            ),
            default=float("nan"),
        )
        print(
            f"| {variant} | {len(ok)}/{len(results)} | "
            f"{statistics.median(recover) if recover else float('nan'):.2f} | "
            f"{statistics.median(r['wall_s'] for r in results):.2f} | "
            f"{max(r['left'] for r in results)} | {dw:.2g} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
