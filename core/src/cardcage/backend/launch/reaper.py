"""A reaper: the processes of a job's own service (a local Ray) and its folder, never left
behind, even when the process that started them is SIGKILLed.

Processes that a service starts in sessions of their own (Ray's raylet, its workers, its
``DashboardAgent`` and ``RuntimeEnvAgent``) do not die with their caller, and a killed
caller cannot remove their folder. So before starting the service, the caller starts a
:class:`Reaper` (``python -I .../reaper.py``: this file imports the standard library only),
in a session of its own, without the marker, holding the read end of a pipe whose write end
only the caller holds, and puts the marker :data:`REAPED` ``=<name>`` in ``os.environ``
while the service starts (:meth:`Reaper.marking`), so that every process of the service
inherits it. When the pipe reaches its end (the caller closed it, or died, even by SIGKILL:
the kernel closes its files), the reaper SIGKILLs every process whose environment
(``/proc/<pid>/environ``) carries the marker, again until it has seen none for
:data:`QUIET_S`, then removes the folder and exits. On a normal end the caller stops the
service, then :meth:`Reaper.finish` closes the pipe and waits for the reaper. Linux only
(``/proc``); elsewhere nothing is killed, the folder is still removed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["QUIET_S", "REAPED", "Reaper", "marked_processes", "reap"]

#: The marker variable: ``CARDCAGE_REAPED=<name>`` in every process to be killed.
REAPED = "CARDCAGE_REAPED"
#: How long the reaper must see no marked process before it removes the folder and exits.
QUIET_S = 1.0
#: How long it goes on killing at most (a service that keeps starting processes).
GIVE_UP_S = 60.0
#: How often it scans ``/proc`` while it kills.
SCAN_S = 0.05


def marked_processes(name: str, skip: tuple[int, ...] = ()) -> list[int]:
    """The live (non-zombie) processes whose environment holds ``REAPED=<name>``."""
    needle = f"{REAPED}={name}".encode()
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit() or int(entry) in skip:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                if stat.read().rpartition(b")")[2].split()[0] in (b"Z", b"X"):
                    continue
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if needle in environ.read().split(b"\0"):
                    found.append(int(entry))
        except (OSError, IndexError):
            continue
    return found


def reap(name: str, folder: str | os.PathLike[str], skip: tuple[int, ...] = ()) -> list[int]:
    """SIGKILL every process marked ``name`` until none is seen for :data:`QUIET_S` (or
    :data:`GIVE_UP_S` passed), then remove ``folder``; return the pids killed."""
    skip = (os.getpid(), *skip)
    killed: list[int] = []
    started = quiet_since = time.monotonic()
    while True:
        now = time.monotonic()
        found = marked_processes(name, skip)
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                if pid not in killed:
                    killed.append(pid)
        if found:
            quiet_since = now
        elif now - quiet_since >= QUIET_S or now - started >= GIVE_UP_S:
            break
        time.sleep(SCAN_S)
    shutil.rmtree(folder, ignore_errors=True)
    return killed


class Reaper:
    """The reaper of one job's service: its processes marked ``name``, and ``folder``."""

    def __init__(self, folder: str | os.PathLike[str], name: str | None = None) -> None:
        self.folder = Path(folder)
        self.name = name or self.folder.name
        read, self._write = os.pipe()  # neither end inherited by what the caller starts
        env = {k: v for k, v in os.environ.items() if k != REAPED}
        try:
            self.process = subprocess.Popen(
                # The file itself (stdlib only), isolated: whatever the caller's sys.path is.
                [sys.executable, "-I", __file__, self.name, str(self.folder), str(os.getpid())],
                stdin=read,
                env=env,
                start_new_session=True,  # outlives the caller's process group being killed
            )
        except BaseException:
            os.close(self._write)
            raise
        finally:
            os.close(read)

    @contextlib.contextmanager
    def marking(self) -> Iterator[None]:
        """``REAPED=<name>`` in ``os.environ`` while the service starts (its processes
        inherit it), then ``os.environ`` as it was."""
        before = os.environ.get(REAPED)
        os.environ[REAPED] = self.name
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(REAPED, None)
            else:
                os.environ[REAPED] = before

    def finish(self, timeout: float = GIVE_UP_S + 30) -> None:
        """Close the pipe (the reaper kills what is left of the service and removes its
        folder) and wait for the reaper to end."""
        if self._write >= 0:
            os.close(self._write)
            self._write = -1
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def main(argv: list[str]) -> None:
    """``python -I reaper.py NAME FOLDER CALLER``: wait for the end of
    stdin, then :func:`reap`."""
    name, folder, caller = argv
    with contextlib.suppress(OSError):
        while os.read(0, 4096):
            pass
    reap(name, folder, skip=(int(caller),))


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the caller's terminal
    main(sys.argv[1:])
