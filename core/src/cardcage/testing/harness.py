"""Starting multi-process jobs from a test, and making sure none of their processes stays.

Every process a :class:`Harness` starts carries its marker in the environment
(``CARDCAGE_TEST_MARKER``); relaunched children, spawned workers and torchrun's or
horovodrun's workers inherit it, so a scan of ``/proc`` finds them all. Each harness gives
its jobs their own ``TMPDIR`` and checks that the launchers left no ``cardcage-*`` folder.
Script relaunch re-runs ``sys.argv[0]``, which under pytest is pytest: that is why training
tests run their job as a script of its own (:mod:`cardcage.testing.job`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from cardcage.config import variables

MARKER = "CARDCAGE_TEST_MARKER"
#: Seconds a job may take on a loaded two-core machine (start-up dominates).
RUN_TIMEOUT = float(os.environ.get("CARDCAGE_TEST_TIMEOUT", "600"))
#: Variables of an enclosing launcher that must not leak into the jobs a test starts: a
#: cluster's, and those cardcage sets for the processes it starts (every internal one, the
#: fit's identity among them, and a restart's checkpoint and folder); a job started from
#: inside a fit (a test of a test kit, a notebook's fit) is then a run of its own.
LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "OMP_NUM_THREADS",
    *(name for name in variables.INTERNAL if not name.endswith("*")),
    variables.CHECKPOINT_DIR,
    variables.RESTART_FROM,
    variables.GPUS,
    "PL_TRAINER_GPUS",
)


def leftover_processes(marker: str) -> dict[int, str]:
    """Live (non-zombie) processes whose command line or environment holds ``marker``."""
    found = {}
    needle = marker.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        base = Path("/proc") / entry
        try:
            stat = (base / "stat").read_text()
            if stat.rpartition(")")[2].split()[0] in ("Z", "X"):
                continue
            cmdline = (base / "cmdline").read_bytes()
            environ = (base / "environ").read_bytes()
        except OSError:
            continue
        if needle in cmdline or needle in environ:
            found[int(entry)] = cmdline.replace(b"\0", b" ").decode(errors="replace")
    return found


def kill_group(popen: subprocess.Popen[bytes]) -> None:
    """SIGKILL a command started in its own session, and everything in that session."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, signal.SIGKILL)


@dataclass
class Run:
    """A started command, its output files and, once it ended, its exit status."""

    name: str
    popen: subprocess.Popen[bytes]
    stdout_path: Path
    stderr_path: Path

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def output(self) -> str:
        return f"--- stdout ---\n{self.stdout[-3000:]}\n--- stderr ---\n{self.stderr[-8000:]}"

    def wait(self, timeout: float = RUN_TIMEOUT) -> int:
        """The exit status; a job still running after ``timeout`` is killed and fails."""
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(self.popen)
            self.popen.wait(timeout=30)
            raise AssertionError(
                f"{self.name} did not end within {timeout:.0f}s (killed)\n{self.output()}"
            ) from None

    def check(self, timeout: float = RUN_TIMEOUT) -> Run:
        """Wait, and fail with the output unless it exited 0."""
        code = self.wait(timeout)
        assert code == 0, f"{self.name} exited {code}\n{self.output()}"
        return self


@dataclass
class Harness:
    """Starts a test's jobs (all marked) and checks that none of their processes survive."""

    root: Path
    marker: str = field(default_factory=lambda: f"cardcage-test-{uuid.uuid4().hex}")
    runs: list[Run] = field(default_factory=list)
    #: What :meth:`env` removes from this environment.
    launcher_variables: ClassVar[tuple[str, ...]] = LAUNCHER_VARIABLES
    #: What :meth:`start` returns (a subclass of :class:`Run` may add to it).
    run_class: ClassVar[type[Run]] = Run

    @property
    def tmpdir(self) -> Path:
        path = self.root / "tmp"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def env(self, **extra: str | None) -> dict[str, str]:
        """This environment without any launcher's variables, plus the marker and ``extra``
        (a value of None removes the variable)."""
        env = {k: v for k, v in os.environ.items() if k not in self.launcher_variables}
        env.update({MARKER: self.marker, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"})
        env["TMPDIR"] = str(self.tmpdir)  # where the launchers' temporary folders go
        for key, value in extra.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def start(self, command: list[str], env: dict[str, str] | None = None, name: str = "") -> Run:
        index = len(self.runs)
        stdout, stderr = self.root / f"run{index}.stdout", self.root / f"run{index}.stderr"
        self.root.mkdir(parents=True, exist_ok=True)
        with stdout.open("wb") as out, stderr.open("wb") as err:
            popen = subprocess.Popen(
                command,
                env=env if env is not None else self.env(),
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                cwd=self.root,
                start_new_session=True,  # the timeout path kills the whole session
            )
        run = self.run_class(name or " ".join(command[:4]), popen, stdout, stderr)
        self.runs.append(run)
        return run

    def assert_no_leftovers(self, grace: float = 10.0) -> None:
        """Every process this harness started is gone (after ``grace`` seconds at most), and
        the launchers left no temporary folder."""
        left = self._kill_leftovers(grace)
        assert not left, f"processes left behind {grace:.0f}s after the job ended: {left}"
        folders = sorted(p.name for p in self.tmpdir.glob("cardcage-*"))
        assert not folders, f"temporary folders left behind: {folders}"

    def cleanup(self, grace: float = 5.0) -> dict[int, str]:
        """Kill whatever is still running; return the processes that had to be killed.

        A helper that ends by itself just after its job (multiprocessing's resource tracker
        exits when it reads its launcher's end of a pipe close) gets ``grace`` seconds: on a
        loaded machine that takes longer than the scan, and it is not one left behind.
        """
        for run in self.runs:
            if run.popen.poll() is None:
                kill_group(run.popen)
        with contextlib.suppress(subprocess.TimeoutExpired):
            for run in self.runs:
                run.popen.wait(timeout=10)
        return self._kill_leftovers(grace)

    def _kill_leftovers(self, grace: float) -> dict[int, str]:
        """Wait up to ``grace`` seconds for this harness's processes to end; SIGKILL and
        return those still alive then."""
        deadline = time.monotonic() + grace
        left = leftover_processes(self.marker)
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = leftover_processes(self.marker)
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        return left


PYTHON = sys.executable
