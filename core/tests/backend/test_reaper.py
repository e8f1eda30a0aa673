"""The reaper kills every process carrying its marker, and removes its folder, once the
pipe its caller holds reaches its end: when the caller finishes, and when it is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from cardcage.backend.launch import reaper
from cardcage.testing.harness import leftover_processes

#: A caller: starts a reaper, and under its marker a child in a session of its own (as Ray
#: starts its agents), prints the child's pid, then waits to be killed or told to finish.
CALLER = textwrap.dedent(
    """
    import os, subprocess, sys
    from cardcage.backend.launch.reaper import Reaper
    folder, mode = sys.argv[1:]
    job = Reaper(folder)
    with job.marking():
        child = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
        )
    assert "CARDCAGE_REAPED" not in os.environ  # restored
    print(child.pid, job.process.pid, flush=True)
    if mode == "finish":
        sys.stdin.readline()
        job.finish()
        print("finished", flush=True)
    else:
        import time; time.sleep(600)
    """
)


def start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], Path, int, int]:
    folder = tmp_path / "service"
    folder.mkdir()
    (folder / "session").write_text("the service's files")
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER, str(folder), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert caller.stdout is not None
    child, reaping = map(int, caller.stdout.readline().split())
    assert reaper.marked_processes(folder.name) == [child]
    return caller, folder, child, reaping


def gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in "ZX"
    except OSError:
        return False


def test_a_finished_caller_has_its_marked_processes_killed_and_folder_removed(
    tmp_path: Path,
) -> None:
    caller, folder, child, reaping = start(tmp_path, "finish")
    try:
        out, _ = caller.communicate("\n", timeout=30)
        assert "finished" in out  # finish() returned: the reaper had ended
        assert not _alive(child) and not _alive(reaping)
        assert not folder.exists()
    finally:
        caller.kill()
        caller.wait()
        for pid in (child, reaping):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_sigkilled_caller_has_its_marked_processes_killed_and_folder_removed(
    tmp_path: Path,
) -> None:
    caller, folder, child, reaping = start(tmp_path, "wait")
    try:
        caller.kill()  # SIGKILL: nothing of the caller runs
        caller.wait(timeout=10)
        assert gone(child, within=10), "the marked child outlived its SIGKILLed caller"
        assert gone(reaping, within=10), "the reaper did not end"
        assert not folder.exists()
    finally:
        caller.kill()
        caller.wait()
        for pid in (child, reaping):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_reaper_carries_no_marker_and_kills_only_its_own(tmp_path: Path) -> None:
    """A process marked with another name is left alone."""
    other = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        env={**os.environ, reaper.REAPED: "another-job"},
    )
    try:
        caller, folder, child, _reaping = start(tmp_path, "finish")
        caller.communicate("\n", timeout=30)
        assert not _alive(child)
        assert _alive(other.pid)
        assert not leftover_processes(f"{reaper.REAPED}={folder.name}")
    finally:
        caller.kill()
        caller.wait()
        other.kill()
        other.wait()
