"""Spawn launchers leave nothing behind: not their workers when a start fails part-way, not
their folder (the pickled model and data) when they are killed.

- A ``ddp_spawn`` launcher killed with SIGKILL cannot remove its ``cardcage-workers-*``
  folder; the next launch in the same temporary folder does, and never removes the folder
  of a launcher that is alive. The folder is private (mode 0700) while the job runs.
- SIGHUP to a launcher (a closed terminal) stops it as SIGTERM does: every rank, its
  folder, exit status 128 + 1.
- A start that fails part-way (a real ``RLIMIT_NOFILE``: every start takes descriptors)
  stops the workers already started before ``fit`` raises, naming the rank and the cause;
  a notebook that catches the error keeps no worker waiting for the missing rank.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import time
from typing import Any

import pytest

from cardcage.backend.launch import tempdirs
from cardcage.backend.launch.workers import FOLDER_PREFIX

from .conftest import PYTHON, SCRIPTS, leftover_processes

pytestmark = pytest.mark.slow

SPAWN = ["--backend", "ddp_spawn", "--num-processes", "2"]
#: Slow enough steps that the job is still training when the test acts.
SLOW = ["--samples", "1600", "--step-sleep", "0.2"]


def worker_folders(harness: Any) -> list[str]:
    return sorted(p.name for p in harness.tmpdir.glob(f"{FOLDER_PREFIX}*"))


def wait_gone(harness: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while leftover_processes(harness.marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not leftover_processes(harness.marker), "the killed launcher's workers outlived it"


def test_a_killed_launchers_folder_is_removed_by_the_next_launch(harness: Any) -> None:
    first, second = harness.root / "first", harness.root / "second"
    run = harness.python_job(first, *SPAWN, *SLOW)
    harness.wait_for_files([first / "pid-rank0", first / "pid-rank1"], run)
    (name,) = worker_folders(harness)
    folder = harness.tmpdir / name
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700, oct(folder.stat().st_mode)
    assert (folder / "job.pickle").exists()
    os.kill(run.pid, signal.SIGKILL)
    assert run.wait() == -signal.SIGKILL
    wait_gone(harness)  # its workers die with it (PR_SET_PDEATHSIG)
    assert worker_folders(harness) == [name]  # what SIGKILL leaves: the pickled job
    # A folder whose launcher is alive (this test's process) is never removed.
    alive = tempdirs.make(FOLDER_PREFIX, root=harness.tmpdir)
    harness.python_job(second, *SPAWN).check()
    assert worker_folders(harness) == [alive.name]
    alive.rmdir()
    harness.assert_no_leftovers()


def test_sighup_to_a_spawn_launcher_stops_every_rank_and_removes_its_folder(
    harness: Any,
) -> None:
    out = harness.root / "out"
    run = harness.python_job(out, *SPAWN, *SLOW)
    harness.wait_for_files([out / "pid-rank0", out / "pid-rank1"], run)
    assert len(worker_folders(harness)) == 1
    os.kill(run.pid, signal.SIGHUP)
    assert run.wait(timeout=60) == 128 + signal.SIGHUP, run.stderr
    harness.assert_no_leftovers()  # no rank, no folder


def test_a_spawn_that_fails_part_way_stops_the_workers_it_started(harness: Any) -> None:
    out = harness.root / "out"
    # 16 workers, room for 24 more descriptors: the start of about the 8th fails.
    command = [PYTHON, str(SCRIPTS / "spawn_limit.py"), str(out), "16", "24"]
    harness.start(command, name="spawn_limit.py").check()
    result = json.loads((out / "spawn_limit.json").read_text())
    assert result["workers_left"] == []  # stopped before fit raised
    error = result["error"]
    found = re.match(
        r"RankFailedError: rank (\d+) could not be started \(OSError: \[Errno 24\] Too many "
        r"open files\) after (\d+) of 16 worker\(s\) had been",
        error,
    )
    assert found, error
    assert int(found[1]) == int(found[2]) >= 1, error  # some had started: they were stopped
    assert "every other rank was stopped" in error
    harness.assert_no_leftovers()  # and the folder with the job is gone
