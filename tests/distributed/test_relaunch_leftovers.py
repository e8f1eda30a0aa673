"""A script-relaunch launcher killed outright leaves nothing behind for good: its private
folders (``cardcage-errors-*``: the ranks' error files and progress counts;
``cardcage-checkpoints-*``: ``last.ckpt``, the model's weights, when ``max_restarts`` keeps
step checkpoints without ``default_root_dir``) are removed by the next launch in the same
temporary folder, never while their launcher is alive.
"""

from __future__ import annotations

import os
import signal
import stat
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cardcage.backend.launch import tempdirs
from cardcage.backend.launch.relaunch import ERRORS_PREFIX
from cardcage.backend.launch.restarts import FOLDER_PREFIX as CHECKPOINTS_PREFIX
from cardcage.config import owners

from .conftest import leftover_processes

JOB = Path(__file__).parent / "scripts" / "restart_job.py"

pytestmark = pytest.mark.slow


def folders(harness: Any) -> list[str]:
    return sorted(p.name for p in harness.tmpdir.glob("cardcage-*"))


def restart_job(harness: Any, out: Path, *options: str) -> Any:
    """``ddp`` (this process is rank 0 and relaunches rank 1), max_restarts=1, a step
    checkpoint every 2 steps, no ``default_root_dir``: fit makes the checkpoints' folder."""
    out.mkdir(parents=True)
    command = [sys.executable, str(JOB), str(out), "ddp", "straight", "1", *options]
    return harness.start(command, name=f"restart_job.py {out.name}")


def test_a_killed_relaunch_launchers_folders_are_removed_by_the_next_launch(
    harness: Any,
) -> None:
    first, second = harness.root / "first", harness.root / "second"
    # Rank 0, the launcher, stalls inside its first step checkpoint's write: both folders
    # exist, the checkpoints' one with the partial file in it.
    run = restart_job(harness, first, "write=stall")
    harness.wait_for_files([first / "in-write"], run)
    made = folders(harness)
    assert [name.rpartition("-")[0] for name in made] == [
        f"{CHECKPOINTS_PREFIX}{owners.owner(run.pid)}",
        f"{ERRORS_PREFIX}{owners.owner(run.pid)}",
    ]
    for name in made:
        mode = stat.S_IMODE((harness.tmpdir / name).stat().st_mode)
        assert mode == 0o700, (name, oct(mode))
    os.kill(run.pid, signal.SIGKILL)
    assert run.wait() == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while leftover_processes(harness.marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not leftover_processes(harness.marker), "rank 1 outlived its launcher"
    assert folders(harness) == made  # what SIGKILL leaves: the weights among them
    # Folders of a launcher that is alive (this test's process) are never removed.
    alive = [tempdirs.make(p, root=harness.tmpdir) for p in (ERRORS_PREFIX, CHECKPOINTS_PREFIX)]
    restart_job(harness, second).check()
    assert folders(harness) == sorted(folder.name for folder in alive)
    for folder in alive:
        folder.rmdir()
    harness.assert_no_leftovers()
