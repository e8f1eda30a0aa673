"""A local Ray the job starts leaves nothing behind: no session folder and no Ray process,
after a fit that ends and after a caller SIGKILLed mid-fit.

Each job gets a ``RAY_TMPDIR`` of its own (short: Ray's Unix sockets go under it), which the
test inspects: the session's one (``conftest.py``) is removed at the end of the session and
would hide a folder left there. The processes are found by the harness's marker, which every
process of the job inherits (Ray's raylet, workers, DashboardAgent, RuntimeEnvAgent)."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cardcage.testing.harness import Harness, Run, leftover_processes

JOB = Path(__file__).parent / "ray_job.py"
#: How long a SIGKILLed caller's Ray may take to be gone, processes and folder.
KILLED_WITHIN_S = 15.0


@pytest.fixture
def ray_tmpdir() -> Iterator[Path]:
    """A short folder for the job's ``RAY_TMPDIR``, empty."""
    folder = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def start(harness: Harness, out: Path, mode: str, ray_tmpdir: Path) -> Run:
    out.mkdir(parents=True)
    command = [sys.executable, str(JOB), str(out), "ray", mode, "nodes=1", "procs=2"]
    env = harness.env(RAY_ADDRESS="", RAY_TMPDIR=str(ray_tmpdir))
    return harness.start(command, env, name=f"ray {mode}")


def test_a_finished_fit_leaves_no_ray_session_nor_process(tmp_path: Path, ray_tmpdir: Path) -> None:
    """When ``fit`` has returned and the script exited, its Ray's session folder is gone and
    no process of its Ray is alive (before: ``RAY_TMPDIR/ray/session_*`` stayed, and Ray's
    agents outlived the job)."""
    harness = Harness(tmp_path)
    try:
        job = start(harness, tmp_path / "out", "plain", ray_tmpdir)
        job.check()
        left = leftover_processes(harness.marker)
        folders = sorted(os.listdir(ray_tmpdir))
    finally:
        harness.cleanup()
    assert left == {}, f"processes of the job's Ray alive after it exited: {left}"
    assert folders == [], f"left in RAY_TMPDIR: {folders}"


def test_a_killed_caller_leaves_no_ray_session_nor_process(
    tmp_path: Path, ray_tmpdir: Path
) -> None:
    """The caller SIGKILLed while its ranks train: within 15 s no process of its Ray is alive
    and its session folder is gone (before: ``ray::DashboardAgent`` and ``RuntimeEnvAgent``
    outlived it by 36-100 s, and the folder stayed)."""
    harness = Harness(tmp_path)
    out = tmp_path / "out"
    try:
        job = start(harness, out, "stuck", ray_tmpdir)  # rank 1 sleeps in its third step
        deadline = time.monotonic() + 300
        while not (out / "starts").exists():  # rank 0 is in its first step
            assert job.popen.poll() is None, job.output()
            assert time.monotonic() < deadline, job.output()
            time.sleep(0.2)
        os.kill(job.popen.pid, signal.SIGKILL)
        job.popen.wait(timeout=30)
        killed = time.monotonic()
        while time.monotonic() - killed < KILLED_WITHIN_S:
            left = leftover_processes(harness.marker)
            folders = sorted(os.listdir(ray_tmpdir))
            if not left and not folders:
                break
            time.sleep(0.2)
        took = time.monotonic() - killed
    finally:
        harness.cleanup()
    assert left == {}, f"alive {took:.0f}s after the caller was SIGKILLed: {left}"
    assert folders == [], f"left in RAY_TMPDIR {took:.0f}s after the SIGKILL: {folders}"
