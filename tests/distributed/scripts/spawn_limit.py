"""A ``ddp_spawn`` fit that hits a real limit part-way through starting its workers:
``python spawn_limit.py OUT NUM_PROCESSES SPARE_FILES``.

Before ``fit``, this process may open only ``SPARE_FILES`` more files (``RLIMIT_NOFILE``,
which binds root too, unlike ``RLIMIT_NPROC``); every worker ``start()`` takes descriptors
(its pipes), so a start part-way through fails with ``EMFILE``, as one fails with
``EAGAIN`` under a pids limit. This process stays alive afterwards, as a notebook would,
and writes ``OUT/spawn_limit.json``: the error ``fit`` raised, and the spawned workers still
alive when it returned (``--multiprocessing-fork`` children of this process).
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

from job import Job, options  # this folder's job.py

import cardcage


def workers() -> list[int]:
    """This process's live spawned workers (multiprocessing's resource tracker is not one)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text().rpartition(")")[2].split()
            cmdline = Path("/proc", entry, "cmdline").read_bytes()
        except OSError:
            continue
        if (
            stat[1] == str(os.getpid())
            and stat[0] not in "ZX"
            and b"multiprocessing-fork" in cmdline
        ):
            found.append(int(entry))
    return found


def main(out: Path, processes: int, spare: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model = Job(options(["--out", str(out), "--step-sleep", "0.5"]))
    trainer = cardcage.Trainer(
        distributed_backend="ddp_spawn", num_processes=processes, progress_bar=False
    )
    result: dict[str, Any] = {}
    open_now = len(os.listdir("/proc/self/fd"))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + spare, hard))
    try:
        trainer.fit(model)
    except Exception as error:  # what a notebook's user sees
        result["error"] = f"{type(error).__name__}: {error}"
        result["cause"] = repr(error.__cause__)
    result["workers_left"] = workers()  # at once: the fit has returned
    (out / "spawn_limit.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
