"""The harness of the distributed tests: start jobs, read what their ranks left, and make
sure that no process a test started outlives it.

Every process a test starts carries the test's marker in its environment
(``CARDCAGE_TEST_MARKER``) and, for ``scripts/job.py``, in its command line (``--marker``);
relaunched children, spawned workers and torchrun's workers inherit the environment, so a
scan of ``/proc`` finds them all. ``harness.assert_no_leftovers()`` waits a few seconds for
them to go, then kills any that remain and fails; the fixture's teardown does the same for
tests that stopped before calling it. Each harness also gives its jobs their own ``TMPDIR``
and checks that the launchers left no ``cardcage-*`` folder there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from cardcage.testing import harness as kit_harness

SCRIPTS = Path(__file__).parent / "scripts"
JOB = SCRIPTS / "job.py"
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
MARKER = kit_harness.MARKER
#: Seconds a normal job may take on a loaded two-core machine (start-up dominates).
RUN_TIMEOUT = 180.0
#: A fault (a failing, killed or signalled rank) must end the job this fast.
FAULT_DEADLINE = 30.0
#: How many scenarios of a module run at once (``CARDCAGE_TEST_JOBS``).
JOBS = int(os.environ.get("CARDCAGE_TEST_JOBS", "4"))
#: Variables of an enclosing launcher that must not leak into the jobs a test starts (the
#: kit's, and the GPUs a job may see).
LAUNCHER_VARIABLES = (*kit_harness.LAUNCHER_VARIABLES, "CUDA_VISIBLE_DEVICES")


def load_job_module() -> Any:
    """``scripts/job.py`` as a module (``reference_weights``, ``Job``), importable by name so
    that its classes pickle."""
    name = "cardcage_distributed_test_job"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, JOB)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def leftover_processes(marker: str) -> dict[int, str]:
    """What a scan of ``/proc`` finds for ``marker`` (the conformance kit's scan)."""
    return kit_harness.leftover_processes(marker)


@dataclass
class Run(kit_harness.Run):
    """The kit's run, with when it started and ended (fault tests time the end)."""

    started: float = field(default_factory=time.monotonic)
    ended: float | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def wait(self, timeout: float = RUN_TIMEOUT) -> int:
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(self.popen)
            self.popen.wait(timeout=30)
            pytest.fail(
                f"{self.name} did not end within {timeout:.0f}s (killed)\n"
                f"--- stdout ---\n{self.stdout[-3000:]}\n--- stderr ---\n{self.stderr[-6000:]}"
            )
        if self.ended is None:
            self.ended = time.monotonic()
        return code

    def check(self, timeout: float = RUN_TIMEOUT) -> Run:
        """Wait, and fail with the output unless it exited 0."""
        code = self.wait(timeout)
        assert code == 0, (
            f"{self.name} exited {code}\n--- stdout ---\n{self.stdout[-3000:]}\n"
            f"--- stderr ---\n{self.stderr[-6000:]}"
        )
        return self

    def result_lines(self) -> list[dict[str, Any]]:
        """The ``RESULT {...}`` lines the job's processes printed."""
        return [
            json.loads(line.partition(" ")[2])
            for line in self.stdout.splitlines()
            if line.startswith("RESULT ")
        ]


kill_group = kit_harness.kill_group


@dataclass
class Harness(kit_harness.Harness):
    """The kit's harness (marked jobs, no process or folder left behind), with this suite's
    job script, torchrun, and readers of what the jobs left."""

    launcher_variables = LAUNCHER_VARIABLES
    run_class = Run
    runs: list[Run] = field(default_factory=list)  # type: ignore[assignment]

    def job_args(self, out: Path, *args: str) -> list[str]:
        return [str(JOB), "--out", str(out), "--marker", self.marker, *args]

    def start(self, command: list[str], env: dict[str, str] | None = None, name: str = "") -> Run:
        run = super().start(command, env, name)
        assert isinstance(run, Run)
        return run

    def python_job(self, out: Path, *args: str, env: dict[str, str] | None = None) -> Run:
        """``python job.py --out OUT ARGS`` (a launching process, as a user runs it)."""
        return self.start([PYTHON, *self.job_args(out, *args)], env, f"python job.py {out.name}")

    def torchrun_job(
        self, out: Path, torchrun_args: list[str], *args: str, env: dict[str, str] | None = None
    ) -> Run:
        """``torchrun TORCHRUN_ARGS job.py --out OUT ARGS``."""
        return self.start(
            [TORCHRUN, *torchrun_args, *self.job_args(out, *args)],
            env,
            f"torchrun job.py {out.name}",
        )

    # -- reading what a job left -------------------------------------------------------------

    @staticmethod
    def results(out: Path) -> dict[int, dict[str, Any]]:
        """``{rank: result}``: what each process that ran the script reported after fit."""
        return read_rank_files(out, "result")

    @staticmethod
    def infos(out: Path) -> dict[int, dict[str, Any]]:
        """``{rank: info}``: what each rank recorded from inside its training steps."""
        return read_rank_files(out, "info")

    @staticmethod
    def free_port() -> int:
        return free_port()

    @staticmethod
    def wait_for_files(paths: list[Path], run: Run, timeout: float = RUN_TIMEOUT) -> None:
        wait_for_files(paths, run, timeout)

    @staticmethod
    def job_module() -> Any:
        """``scripts/job.py`` imported (its model and data, for in-process tests)."""
        return load_job_module()

    @staticmethod
    def reference(batch_size: int, epochs: int = 1, samples: int = 64) -> list[float]:
        """Final weights of a plain PyTorch loop, one process, over the unshuffled data."""
        weights: list[float] = load_job_module().reference_weights(batch_size, epochs, samples)
        return weights


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    helper = Harness(tmp_path)
    yield helper
    left = helper.cleanup()
    assert not left, f"processes left behind by the test: {left}"


@pytest.fixture(scope="module")
def module_harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    """A harness shared by the tests of a module that check one job's output."""
    helper = Harness(tmp_path_factory.mktemp("job"))
    yield helper
    left = helper.cleanup()
    assert not left, f"processes left behind by the module's jobs: {left}"


def read_rank_files(out: Path, kind: str) -> dict[int, dict[str, Any]]:
    """``{rank: data}`` of the ``<kind>-rank<R>.json`` files a job left in ``out``."""
    found = {}
    for path in sorted(out.glob(f"{kind}-rank*.json")):
        found[int(path.stem.removeprefix(f"{kind}-rank"))] = json.loads(path.read_text())
    return found


def wait_for_files(paths: list[Path], run: Run, timeout: float = RUN_TIMEOUT) -> None:
    """Wait until every path exists (the job reached a point), failing if the job ends."""
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if run.popen.poll() is not None:
            pytest.fail(
                f"{run.name} ended (exit {run.returncode}) before writing {paths}\n"
                f"--- stderr ---\n{run.stderr[-6000:]}"
            )
        if time.monotonic() > deadline:
            pytest.fail(f"{run.name} did not write {paths} within {timeout:.0f}s")
        time.sleep(0.05)


# -- scenarios: a module's jobs, run concurrently --------------------------------------------
#
# Starting a process that imports torch costs seconds of CPU, and most of a distributed
# test is waiting (for start-up, for a rank to reach a step, for a fault to be handled). A
# module lists its scenarios in ``SCENARIOS = {name: function(harness) -> value}``; its tests
# take a ``scenario`` parameter naming one. The first test to ask starts every scenario
# selected in the module (``-k`` is honoured), ``JOBS`` at a time, each with its own harness
# (folder and marker); each test then waits for its scenario's value, or its failure.


class Scenarios:
    def __init__(
        self, root: Path, table: dict[str, Callable[[Harness], Any]], names: list[str]
    ) -> None:
        self.harnesses: dict[str, Harness] = {}
        self.futures: dict[str, Future[Any]] = {}
        self.pool = ThreadPoolExecutor(max_workers=max(JOBS, 1), thread_name_prefix="scenario")
        for name in names:
            folder = root / re.sub(r"[^A-Za-z0-9_.-]", "_", name)
            folder.mkdir()
            harness = Harness(folder)
            self.harnesses[name] = harness
            self.futures[name] = self.pool.submit(table[name], harness)

    def result(self, name: str) -> Any:
        """The scenario's value; re-raises its failure (an assertion, a timeout) here."""
        return self.futures[name].result()

    def close(self) -> dict[str, dict[int, str]]:
        """Stop what is still running (a test run that was cut short); report leftovers."""
        for name, future in self.futures.items():
            if not future.done():
                future.cancel()
                for run in self.harnesses[name].runs:
                    kill_group(run.popen)
        self.pool.shutdown(wait=True, cancel_futures=True)
        return {name: left for name, h in self.harnesses.items() if (left := h.cleanup())}


@pytest.fixture(scope="module")
def scenarios(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Scenarios]:
    table: dict[str, Callable[[Harness], Any]] = request.module.SCENARIOS
    names: list[str] = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if getattr(item, "module", None) is not request.module or callspec is None:
            continue
        name = callspec.params.get("scenario")
        if name is not None and name not in names:
            names.append(name)
    runner = Scenarios(
        tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2]), table, names
    )
    yield runner
    left = runner.close()
    assert not left, f"processes left behind by the scenarios: {left}"
