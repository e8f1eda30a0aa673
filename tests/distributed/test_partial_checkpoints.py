"""A checkpoint write that a job's end interrupts leaves no partial file behind.

Rank 0 is stopped inside its write of ``last.ckpt``, after the temporary file was made (its
scheduler's state holds an object whose pickling stops it there: see
``scripts/restart_job.py``). Whether the rank is SIGKILLed there (nothing in it can clean
up: the launcher clears the file once it has stopped the ranks) or the launcher is SIGTERMed
and stops every rank (the writer removes its own file on the way out), ``default_root_dir``
holds no ``.tmp`` file when the launcher has returned, and no process is left.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

JOB = Path(__file__).parent / "scripts" / "restart_job.py"

pytestmark = pytest.mark.slow


def start(harness: Any, out: Path, backend: str, write: str) -> Any:
    out.mkdir(parents=True)
    # max_restarts=0: the first failure ends the job; a step checkpoint every 2 steps.
    command = [sys.executable, str(JOB), str(out), backend, "straight", "0"]
    command += [f"write={write}", "every=2", f"root={out / 'root'}"]
    return harness.start(command, name=f"{backend} write={write}")


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.endswith(".tmp"))


def test_a_rank_killed_inside_a_write_leaves_no_partial_file(harness: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = start(harness, out, "ddp_spawn", "die")
    assert job.wait() != 0
    harness.assert_no_leftovers()
    assert (out / "in-write").exists()  # rank 0 did die inside the write
    assert "rank 0 was killed by signal 9" in job.stderr
    assert leftovers(out / "root") == []


@pytest.mark.parametrize("backend", ["ddp_spawn", "ddp"])
def test_a_launcher_stopped_during_a_write_leaves_no_partial_file(
    harness: Any, tmp_path: Path, backend: str
) -> None:
    out = tmp_path / "out"
    job = start(harness, out, backend, "stall")
    harness.wait_for_files([out / "in-write"], job)
    assert len(leftovers(out / "root")) == 1  # the write in progress
    os.kill(job.popen.pid, signal.SIGTERM)
    assert job.wait() == 128 + signal.SIGTERM
    harness.assert_no_leftovers()
    assert leftovers(out / "root") == []
