"""Launchers' temporary folders: private, named after their launcher, and removed by the
next launcher once theirs is gone (never while it is alive, nor another host's)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

from cardcage.backend.launch import tempdirs
from cardcage.config import owners

PREFIX = "cardcage-workers-"


def ended_process() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_folder_is_private_and_names_its_launcher(tmp_path: Path) -> None:
    folder = tempdirs.make(PREFIX, root=tmp_path)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    pid, start, host = tempdirs.launcher_of(folder.name, PREFIX) or (0, "", "")
    assert pid == os.getpid() and start.isdigit()
    assert host == owners.this_host()


def test_only_folders_of_launchers_that_are_gone_are_removed(tmp_path: Path) -> None:
    host = owners.this_host()
    mine = tempdirs.make(PREFIX, root=tmp_path)
    # A dead launcher's folder, as SIGKILL leaves it, with a file in it.
    dead = tmp_path / f"{PREFIX}{ended_process()}.1@{host}-abc_123"
    dead.mkdir()
    (dead / "job.pickle").write_bytes(b"the model and data")
    # This process's pid with another start time: the pid was reused, its launcher is gone.
    reused = tmp_path / f"{PREFIX}{os.getpid()}.1@{host}-def456"
    reused.mkdir()
    kept = [
        mine,
        tmp_path / f"{PREFIX}{ended_process()}.1@another-host-ghi789",  # another machine's
        tmp_path / f"{PREFIX}k2j4h5g6",  # a name that does not say whose it is
        tmp_path / "cardcage-errors-xyz",  # another prefix
    ]
    for folder in kept[1:]:
        folder.mkdir()
    assert sorted(tempdirs.remove_stale(PREFIX, root=tmp_path)) == sorted([dead, reused])
    assert sorted(tmp_path.iterdir()) == sorted(kept)


def test_making_a_folder_removes_the_stale_ones_first(tmp_path: Path) -> None:
    dead = tmp_path / f"{PREFIX}{ended_process()}.1@{owners.this_host()}-abc"
    dead.mkdir()
    made = tempdirs.make(PREFIX, root=tmp_path)
    assert list(tmp_path.iterdir()) == [made]


def test_a_host_name_with_dashes_is_read_back_whole() -> None:
    name = f"{PREFIX}4242.99@node-7.example-a_b1c2"
    assert tempdirs.launcher_of(name, PREFIX) == (4242, "99", "node-7.example")


def test_a_launcher_killed_but_not_yet_reaped_has_ended(tmp_path: Path) -> None:
    """A SIGKILLed launcher whose parent has not waited for it yet is a zombie: it runs no
    more, so its folder goes (its pid and start still read as they were)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        folder = tmp_path / f"{PREFIX}{owners.owner(child.pid)}-abc"
        folder.mkdir()
        assert tempdirs.remove_stale(PREFIX, root=tmp_path) == []  # alive: kept
        child.kill()
        deadline = time.monotonic() + 30
        while Path(f"/proc/{child.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child did not become a zombie"
            time.sleep(0.01)
        assert tempdirs.remove_stale(PREFIX, root=tmp_path) == [folder]
    finally:
        child.kill()
        child.wait()


def test_a_launch_removes_the_dead_launchers_folders_of_every_kind(tmp_path: Path) -> None:
    """A killed ``ddp`` launcher's error files and step checkpoints go at the next launch,
    whichever backend that uses; another program's ``cardcage-*`` name is left alone."""
    host, dead = owners.this_host(), ended_process()
    stale = [
        tmp_path / f"cardcage-{kind}-{dead}.1@{host}-abc"
        for kind in ("errors", "checkpoints", "workers")
    ]
    kept = tmp_path / "cardcage-notes"
    for folder in (*stale, kept):
        folder.mkdir()
    made = tempdirs.make(PREFIX, root=tmp_path)
    assert sorted(tmp_path.iterdir()) == sorted([kept, made])


def test_a_short_folder_records_its_launcher_and_is_removed_once_it_is_gone(
    tmp_path: Path,
) -> None:
    """``make_short`` (a path Ray's sockets go under): ``<prefix><random>``, its owner in a
    file inside it; kept while that owner lives, removed by the next launch once it is gone."""
    prefix = "cardcage-ray-"
    folder = tempdirs.make_short(prefix, root=tmp_path)
    assert len(folder.name) == len(prefix) + 8  # mkdtemp's random part: nothing else
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert (folder / tempdirs.OWNER_FILE).read_text() == owners.owner()
    dead = tmp_path / f"{prefix}deadbeef"
    dead.mkdir()
    (dead / tempdirs.OWNER_FILE).write_text(f"{ended_process()}.1@{owners.this_host()}")
    unknown = tmp_path / f"{prefix}noowner1"  # no owner file: never touched
    unknown.mkdir()
    assert tempdirs.remove_stale(prefix, root=tmp_path) == [dead]
    assert folder.is_dir() and unknown.is_dir()
