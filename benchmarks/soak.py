"""Soak: many consecutive launches of each launcher, quiet and beside a CPU hog.

Usage::

    python benchmarks/soak.py            # relaunch, spawn, torchrun: 20 runs each
    python benchmarks/soak.py --runs 100 --launchers relaunch,spawn,torchrun,srun,horovodrun,xmp
    python benchmarks/soak.py --runs 10 --launchers spawn --hog always --json soak.json

Each run starts a two-process training job (one epoch of 8 steps per rank, a small MLP) the
way a user starts it, and waits for it with a timeout:

* ``relaunch``: ``python soak.py job ddp`` (cardcage re-runs the script for rank 1);
* ``spawn``: ``python soak.py job ddp_spawn`` (spawned workers);
* ``torchrun``: ``torchrun --standalone --nproc-per-node=2 soak.py job ddp``;
* ``srun``: ``srun -N1 -n2 python soak.py job ddp`` on the private SLURM cluster of
  ``tests/slurm/cluster.py``, started here (root and Debian's SLURM packages needed);
* ``horovodrun``: ``horovodrun -np 2 -H localhost:2 python soak.py job horovod``
  (``--horovod-python``: an interpreter with Horovod, default ``.nox/horovod``'s);
* ``xmp``: ``python soak.py job tpu`` with ``PJRT_DEVICE=CPU CPU_NUM_DEVICES=2`` (two XLA CPU
  replicas; ``--xla-python``, default ``.nox/tpu``'s).

``--hog alternate`` (the default) runs every other launch beside a CPU hog, one spinning
process per core, paused (SIGSTOP) between the launches it does not apply to: timing decides
whether torch's exit races show, so both are needed. A run **fails** when it exits non-zero,
prints "terminate called", or leaves a process behind (5 s after it ended); it **hangs** when
it has not ended after ``--timeout`` seconds (its process group is then killed). ``start`` is
the time from the command to the first training step of any rank, ``exit`` from the last
step of any rank to the command's end. It exits 1 when any run failed or hung.
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
import uuid
from pathlib import Path
from typing import Any

import torch

from cardcage.testing.harness import leftover_processes

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve()
MARKER = "CARDCAGE_SOAK_MARKER"
LAUNCHERS = ("relaunch", "spawn", "torchrun", "srun", "horovodrun", "xmp")


# -- the job each launch runs ------------------------------------------------------------------


class Net(torch.nn.Module):
    """A small MLP that logs the time of every step it takes to ``OUT/steps.log``."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )
        self.out = out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with open(Path(self.out, "steps.log"), "a") as log:  # one short line: an atomic append
            log.write(f"{time.time()}\n")
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def job(backend: str, out: str) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    import cardcage

    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(128, 16), torch.randn(128, 1)), batch_size=8)
    flags: dict[str, Any] = {"max_epochs": 1, "progress_bar": False}
    if backend == "tpu":
        flags["tpu_cores"] = 8  # every XLA CPU device: CPU_NUM_DEVICES of them
    else:
        flags.update(distributed_backend=backend, num_processes=2)
    cardcage.Trainer(**flags).fit(Net(out), data)


# -- launching ---------------------------------------------------------------------------------


def command(launcher: str, python: str, out: Path) -> list[str]:
    script = [str(HERE), "job"]
    if launcher == "relaunch":
        return [python, *script, "ddp", str(out)]
    if launcher == "spawn":
        return [python, *script, "ddp_spawn", str(out)]
    if launcher == "torchrun":
        torchrun = str(Path(python).parent / "torchrun")
        return [torchrun, "--standalone", "--nproc-per-node=2", *script, "ddp", str(out)]
    if launcher == "srun":
        return ["srun", "--immediate=30", "-N1", "-n2", python, *script, "ddp", str(out)]
    if launcher == "horovodrun":
        horovodrun = str(Path(python).parent / "horovodrun")
        return [horovodrun, "-np", "2", "-H", "localhost:2", python, *script, "horovod", str(out)]
    if launcher == "xmp":
        return [python, *script, "tpu", str(out)]
    raise ValueError(launcher)


class Hog:
    """One spinning process per core, paused until :meth:`on`."""

    def __init__(self) -> None:
        spin = "while True: pass"
        self.procs = [
            subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 1)
        ]
        self.off()

    def on(self) -> None:
        for proc in self.procs:
            os.kill(proc.pid, signal.SIGCONT)

    def off(self) -> None:
        for proc in self.procs:
            os.kill(proc.pid, signal.SIGSTOP)

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def launch(launcher: str, python: str, env: dict[str, str], timeout: float) -> dict[str, Any]:
    """One launch: its outcome and timings."""
    marker = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="cardcage-soak-") as folder:
        out = Path(folder)
        began = time.time()
        proc = subprocess.Popen(
            command(launcher, python, out),
            env={**env, MARKER: marker, "TMPDIR": folder},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=timeout)
            hung = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            hung = True
        ended = time.time()
        steps = (
            [float(t) for t in (out / "steps.log").read_text().split()]
            if (out / "steps.log").exists()
            else []
        )
        deadline = time.monotonic() + 5
        left = list(leftover_processes(marker))
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = list(leftover_processes(marker))
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    failed = not hung and (proc.returncode != 0 or "terminate called" in output or bool(left))
    return {
        "returncode": proc.returncode,
        "hung": hung,
        "failed": failed,
        "leftovers": len(left),
        "start_s": min(steps) - began if steps else None,
        "exit_s": ended - max(steps) if steps else None,
        "tail": output[-3000:] if failed or hung else "",
    }


def environment(launcher: str, args: argparse.Namespace) -> tuple[str, dict[str, str]] | str:
    """The interpreter and environment a launcher runs with, or why it cannot run here."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "SLURM_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    python = args.python
    if launcher == "horovodrun":
        python = args.horovod_python
        if not (Path(python).parent / "horovodrun").exists():
            return f"no horovodrun beside {python} (run `nox -s horovod` or pass --horovod-python)"
    if launcher == "xmp":
        python = args.xla_python
        probe = subprocess.run([python, "-c", "import torch_xla"], capture_output=True)
        if probe.returncode != 0:
            return f"no torch_xla in {python} (run `nox -s tpu` or pass --xla-python)"
        env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="2")
    if launcher == "srun":
        if args.cluster is None:
            return "no SLURM cluster"
        env.update(args.cluster.env)
    return python, env


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def stats(key: str) -> list[float | None]:
        values = [r[key] for r in runs if r[key] is not None]
        return [statistics.median(values), max(values)] if values else [None, None]

    return {
        "runs": len(runs),
        "failures": sum(r["failed"] for r in runs),
        "hangs": sum(r["hung"] for r in runs),
        "start_s": stats("start_s"),
        "exit_s": stats("exit_s"),
    }


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["job"]:
        job(argv[1], argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--launchers", default="relaunch,spawn,torchrun")
    parser.add_argument("--runs", type=int, default=20, help="launches per launcher")
    parser.add_argument("--hog", choices=("alternate", "never", "always"), default="alternate")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds a launch may take")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--horovod-python", default=str(ROOT / ".nox/horovod/bin/python"))
    parser.add_argument("--xla-python", default=str(ROOT / ".nox/tpu/bin/python"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    launchers = [name.strip() for name in args.launchers.split(",") if name.strip()]
    unknown = sorted(set(launchers) - set(LAUNCHERS))
    if unknown:
        parser.error(f"--launchers: unknown {', '.join(unknown)}; choose from {LAUNCHERS}")
    args.cluster = None
    if "srun" in launchers:
        sys.path.insert(0, str(ROOT))
        from tests.slurm import cluster as slurm

        try:
            args.cluster = slurm.start(tie_to_parent=True)
        except slurm.Unavailable as why:
            print(f"srun: skipped, {why}")
    hog = Hog() if args.hog != "never" else None
    results: dict[str, Any] = {}
    try:
        for launcher in launchers:
            setting = environment(launcher, args)
            if isinstance(setting, str):
                print(f"{launcher}: skipped, {setting}", flush=True)
                continue
            python, env = setting
            runs: dict[str, list[dict[str, Any]]] = {"quiet": [], "hog": []}
            for i in range(args.runs):
                hogged = args.hog == "always" or (args.hog == "alternate" and i % 2 == 1)
                if hog is not None:
                    hog.on() if hogged else hog.off()
                run = launch(launcher, python, env, args.timeout)
                runs["hog" if hogged else "quiet"].append(run)
                if run["failed"] or run["hung"]:
                    what = "hung" if run["hung"] else f"failed (exit {run['returncode']})"
                    print(f"{launcher} run {i + 1} {what}:\n{run['tail']}", flush=True)
            if hog is not None:
                hog.off()
            results[launcher] = {name: summary(r) for name, r in runs.items() if r}
            print(f"{launcher}: {json.dumps(results[launcher])}", flush=True)
    finally:
        if hog is not None:
            hog.stop()
        if args.cluster is not None:
            args.cluster.stop()
    print()
    print(
        "| launcher | machine | runs | failures | hangs | start s (med, max) | exit s (med, max) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for launcher, by_load in results.items():
        for load, s in by_load.items():
            start = "-" if s["start_s"][0] is None else "{:.2f}, {:.2f}".format(*s["start_s"])
            exit_ = "-" if s["exit_s"][0] is None else "{:.2f}, {:.2f}".format(*s["exit_s"])
            print(
                f"| {launcher} | {load} | {s['runs']} | {s['failures']} | {s['hangs']} | "
                f"{start} | {exit_} |"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    bad = sum(s["failures"] + s["hangs"] for by in results.values() for s in by.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
