"""Fits in a row in one process, as a notebook, a sweep or a test file runs them:
``python fits_in_a_row.py OUT``.

1. an ``fsdp`` fit of one process (it trains in this process, as script relaunch's rank 0);
2. a two-process ``ddp_spawn`` fit;
3. an ``fsdp`` fit of one process whose ``training_step`` raises at its second step;
4. a two-process ``ddp_spawn`` fit again.

After each, what a fit could leave in this process (environment, process group, torch
settings, hooks, signal handlers, a hosted store or relaunched job) is compared with what
it was before the first; the differences, the spawn fits' selection and every fit's weights
go to ``OUT/fits_in_a_row.json``. The user chose one torch thread before anything ran.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from job import Job, flat_weights, options, reference_weights  # this folder's job.py

import cardcage


def state() -> dict[str, Any]:
    """What a fit could change in this process."""
    import torch.distributed as dist

    from cardcage.backend.launch import relaunch, rendezvous

    handlers = {}
    for sig in signal.valid_signals():
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            handlers[str(int(sig))] = repr(signal.getsignal(sig))
    return {
        "environ": dict(os.environ),
        "num_threads": torch.get_num_threads(),
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "default_dtype": str(torch.get_default_dtype()),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "grad_enabled": torch.is_grad_enabled(),
        "process_group": dist.is_initialized(),
        "excepthook": repr(sys.excepthook),
        "threading.excepthook": repr(threading.excepthook),
        "handlers": handlers,
        "relaunched_job": relaunch.current_supervisor() is not None,
        "hosted_store": rendezvous.hosted_store() is not None,
    }


def changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """``{what: [before, after]}`` for what differs (variables and handlers one by one)."""
    found: dict[str, Any] = {}
    for key in before:
        if key in ("environ", "handlers"):
            for name in sorted(set(before[key]) | set(after[key])):
                if before[key].get(name) != after[key].get(name):
                    found[f"{key}[{name}]"] = [before[key].get(name), after[key].get(name)]
        elif before[key] != after[key]:
            found[key] = [before[key], after[key]]
    return found


def fsdp_fit(out: Path, *fail: str) -> list[float]:
    model = Job(options(["--out", str(out), "--batch-size", "8", *fail]))
    trainer = cardcage.Trainer(distributed_backend="fsdp", benchmark=True, progress_bar=False)
    trainer.fit(model)
    return flat_weights(model)


def spawn_fit(out: Path) -> dict[str, Any]:
    model = Job(options(["--out", str(out), "--batch-size", "8"]))
    trainer = cardcage.Trainer(distributed_backend="ddp_spawn", num_processes=2, progress_bar=False)
    selection = trainer.selection
    trainer.fit(model)
    return {
        "cluster": selection.cluster,
        "world_size": selection.world_size,
        "warnings": list(selection.warnings),
        "weights": flat_weights(model),
    }


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # the user's choice, made before any fit
    before = state()
    result: dict[str, Any] = {"changes": {}}
    result["fsdp"] = fsdp_fit(out)
    result["changes"]["fsdp"] = changes(before, state())
    result["spawn"] = spawn_fit(out)
    result["changes"]["spawn"] = changes(before, state())
    try:
        fsdp_fit(out, "--fail-rank", "0", "--fail-step", "2")
    except RuntimeError as error:
        result["failure"] = str(error)
    result["changes"]["failed fsdp"] = changes(before, state())
    result["spawn_again"] = spawn_fit(out)
    result["changes"]["spawn again"] = changes(before, state())
    result["reference"] = {str(b): reference_weights(b) for b in (8, 16)}
    (out / "fits_in_a_row.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
