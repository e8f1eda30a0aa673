"""What the Cage's tests share: the job script, starting it, reading what it left
(imported by the test modules as ``cage_helpers``: conftest.py puts it in ``sys.modules``).

``scripts/cage_job.py`` is the job (a file: script relaunch runs ``sys.argv[0]`` again,
torchrun runs it in every process, spawned workers import it); :func:`load_job` imports it
here, for its model, data and plain loop. Each process-starting test module lists its jobs
in ``SCENARIOS = {name: function(harness) -> value}`` and its tests take a ``scenario``
parameter naming one: the first test to ask starts every scenario the selected tests name,
all at once (most of a job is start-up and waiting), each with its own
:class:`~cardcage.testing.harness.Harness` (folder, marker, no process left behind).
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

from cardcage.testing.harness import Harness, Run, kill_group

SCRIPT = Path(__file__).resolve().parent / "scripts" / "cage_job.py"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def load_job() -> ModuleType:
    name = "cardcage_cage_test_job"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its classes and functions pickle by this name
        spec.loader.exec_module(module)
    return sys.modules[name]


def start(
    harness: Harness, *args: str, torchrun: bool = False, env: dict[str, str] | None = None
) -> tuple[Run, Path]:
    """``python cage_job.py OUT ARGS`` (or under ``torchrun --standalone --nproc-per-node
    2``), in the harness's folder; returns the run and OUT."""
    out = harness.root / "out"
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(SCRIPT), str(out), *args]
    if torchrun:
        command = [TORCHRUN, "--standalone", "--nproc-per-node", "2", *command[1:]]
    return harness.start(command, harness.env(**(env or {}))), out


def outputs(out: Path) -> dict[str, Any]:
    """``{stem: data}`` of every JSON file the job left in ``out``."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(out.glob("*.json"))}


def launch_values(found: dict[str, Any]) -> list[dict[str, Any]]:
    """What ``launch`` returned in each process that called it."""
    return [data for name, data in found.items() if name.startswith("launch-")]


def plain_weights(
    job: Any, make_optimizer: Any, epochs: int, seed: int = 0, *, shuffled: bool = False
) -> list[float]:
    """The plain loop's final weights, one process over the global batches (in a shuffled
    loader's order of each epoch, as the ranks together see them, if ``shuffled``)."""
    model = job.make_model(seed)
    optimizer = make_optimizer(model)
    for epoch in range(epochs):
        batches = job.global_batches(epoch) if shuffled else job.loader(job.GLOBAL_BATCH)
        job.train(model, optimizer, batches, epoch + 1, job.plain_backward, start=epoch)
    weights: list[float] = job.weights(model)
    return weights


def max_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


class Scenarios:
    """A module's scenarios, started together in threads, each with its own harness."""

    def __init__(
        self, root: Path, table: dict[str, Callable[[Harness], Any]], names: list[str]
    ) -> None:
        self.harnesses: dict[str, Harness] = {}
        self.futures: dict[str, Future[Any]] = {}
        self.pool = ThreadPoolExecutor(max_workers=max(len(names), 1))
        for name in names:
            harness = Harness(root / re.sub(r"[^A-Za-z0-9_.-]", "_", name))
            self.harnesses[name] = harness
            self.futures[name] = self.pool.submit(table[name], harness)

    def result(self, name: str) -> Any:
        """The scenario's value; re-raises its failure here."""
        return self.futures[name].result()

    def close(self) -> dict[str, dict[int, str]]:
        for name, future in self.futures.items():
            if not future.done():
                future.cancel()
                for run in self.harnesses[name].runs:
                    kill_group(run.popen)
        self.pool.shutdown(wait=True, cancel_futures=True)
        return {name: left for name, h in self.harnesses.items() if (left := h.cleanup())}
