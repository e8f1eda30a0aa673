"""Which rank the supervisor names when a killed rank and the peer that failed because of it
both ended: the killed one, even when its exit status could not be read yet while the peer
had already written its error file (the peer noticed the closed sockets of a process that
was still exiting)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cardcage.backend.launch.error_files import write_error_file
from cardcage.backend.launch.supervisor import Child, Supervisor
from cardcage.config import owners


def test_a_process_on_its_way_out_is_exiting_and_a_running_one_is_not() -> None:
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not owners.exiting(running.pid)
        assert not owners.exiting(os.getpid())
        os.kill(running.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not owners.exiting(running.pid):  # a zombie until reaped below
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        running.kill()
        running.wait()
    assert owners.exiting(running.pid)  # gone


def test_the_killed_rank_is_named_though_its_status_came_last(tmp_path: Path) -> None:
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    peer = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(1)"])
    peer.wait()
    readable = {"killed": False}

    def killed_status() -> int | None:
        # The kernel has the exit status only once the process finished exiting.
        return killed.poll() if readable["killed"] else None

    files = [tmp_path / "rank-0.txt", tmp_path / "rank-1.txt"]
    supervisor = Supervisor(
        children=[
            Child(0, killed.pid, killed_status, files[0]),
            Child(1, peer.pid, peer.poll, files[1]),
        ],
        world_size=2,
    )
    try:
        assert supervisor.first_failure() is not None  # the peer, alone so far
        supervisor._alive_at.clear()
        assert supervisor.first_failure() is not None
        seen_alive = supervisor._alive_at[0]
        os.kill(killed.pid, signal.SIGKILL)  # rank 0 dies ...
        while not owners.exiting(killed.pid):
            time.sleep(0.01)
        write_error_file(RuntimeError("Connection closed by peer"), files[1])  # ... rank 1 sees
        time.sleep(0.05)
        supervisor.first_failure()  # rank 0: no status yet, but on its way out
        assert supervisor._alive_at[0] == seen_alive, "an exiting process counted as running"
        readable["killed"] = True
        failure = supervisor.first_failure()
        assert failure is not None and failure.rank == 0, failure
    finally:
        killed.kill()
        killed.wait()


def test_a_rank_that_finished_and_is_still_exiting_is_no_failure(tmp_path: Path) -> None:
    """A rank that finished its fit and exits normally is seen on its way out before its
    exit status can be read: it is no failure (it was named as having "left the job early
    (exited with status 0 before its fit finished)", about once in ten ddp_spawn fits)."""
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    files = [tmp_path / "rank-0.txt"]
    files[0].with_suffix(".fits").write_text("1")  # its fit finished
    polls = {"n": 0}

    def status() -> int | None:
        polls["n"] += 1  # unreadable at first, as while the process is exiting
        return done.poll() if polls["n"] > 3 else None

    supervisor = Supervisor(children=[Child(0, done.pid, status, files[0])], world_size=1)
    supervisor.runs = 1
    assert supervisor.first_failure() is None
