"""The conformance suite's base: how a backend declares itself, and how its jobs run.

A plugin's tests subclass :class:`~cardcage.testing.BackendSuite` once, naming the backend
and how its jobs are launched; pytest then runs every check against it (the
``cardcage.testing`` pytest plugin parametrizes them). A check the backend cannot run here
skips with the reason it declares in ``skip``, or, for GPU backends on a machine without
CUDA, with that reason.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from cardcage.testing.harness import PYTHON, Harness
from cardcage.testing.models import TRACE
from cardcage.testing.own_loop import TRAINING

#: The scenarios of :mod:`cardcage.testing.job` whose weights are checked against a plain loop.
SCENARIOS = (
    "sgd",
    "adam_shuffled",
    "uneven",
    "drop_last",
    "two_optimizers",
    "optimizer_idx",
    "max_steps",
    "checkpoint",
    "checkpoint_in_step",
    "accumulate",
    "clip",
    "step_scheduler",
    "early_stop",
)
#: The own-loop scenarios (:mod:`cardcage.testing.own_loop`) whose weights are checked.
OWN_LOOP_SCENARIOS = TRAINING
#: Environments a selection is made in: plain, torchrun rank 1, SLURM, horovodrun, 2 nodes.
ENVIRONMENTS: dict[str, dict[str, str]] = {
    "plain": {},
    "torchrun_rank1": {
        "TORCHELASTIC_RUN_ID": "kit",
        "WORLD_SIZE": "2",
        "RANK": "1",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29555",
    },
    "slurm": {
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "0",
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NAME": "train",
        "SLURM_NODELIST": "node1",
    },
    "horovodrun": {
        "HOROVOD_RANK": "1",
        "HOROVOD_SIZE": "2",
        "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2",
    },
    "two_nodes": {"NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29556"},
}


@dataclass(frozen=True)
class Launch:
    """How the kit starts a job: the Trainer flags, the command that starts it and the
    number of training processes (the job's world size).

    ``command``: ``"python"`` (the script, as a user runs it; the backend starts what it
    needs), ``"torchrun"`` (``torchrun --nproc-per-node WORLD``), ``"nodes"`` (WORLD copies
    of the script, one per node, with ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``),
    ``"ranks"`` (WORLD copies of the script, one per rank, as a cluster launcher such as
    jsrun starts them: ``{rank}`` in a value of ``env`` becomes each one's rank, and
    ``MASTER_ADDR``/``MASTER_PORT`` are set), or ``"horovodrun"`` (``horovodrun -np WORLD``).
    """

    flags: Mapping[str, Any]
    world_size: int = 1
    command: str = "python"
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass
class JobOutput:
    """What one launch of the kit's job left."""

    launch: Launch
    harness: Harness
    out: Path
    returncode: int
    output: str

    def result(self, scenario: str, rank: int = 0) -> dict[str, Any]:
        path = self.out / f"{scenario}-rank{rank}.json"
        assert self.returncode == 0 and path.exists(), (
            f"the job exited {self.returncode} without {path.name}\n{self.output}"
        )
        data: dict[str, Any] = json.loads(path.read_text())
        return data

    def results(self, scenario: str, every_rank: bool = False) -> dict[int, dict[str, Any]]:
        """``{rank: result}`` of every process that wrote one for ``scenario``. Rank 0's must
        be there; where the kit started every rank's script itself (torchrun, horovodrun,
        nodes, ranks), every rank's must, or two processes took one rank. Under the
        ``python`` command, spawned workers write none: their caller reports rank 0. With
        ``every_rank`` (the own-loop scenarios, whose training processes write their own),
        every rank's must be there, whatever the command."""
        found: dict[int, dict[str, Any]] = {}
        for path in self.out.glob(f"{scenario}-rank*.json"):
            rank = path.name.removeprefix(f"{scenario}-rank").removesuffix(".json")
            if rank.isdigit():
                found[int(rank)] = self.result(scenario, int(rank))
        wanted = {0}
        if every_rank or self.launch.command != "python":
            wanted = set(range(self.launch.world_size))
        missing = sorted(wanted - set(found))
        assert self.returncode == 0 and not missing, (
            f"the job exited {self.returncode} without the {scenario} result of rank(s) "
            f"{missing} ({len(found)} written)\n{self.output}"
        )
        return dict(sorted(found.items()))

    def traces(self) -> dict[str, list[dict[str, Any]]]:
        """``{"pid/thread": events}`` of every thread that traced: callers and training
        processes (the replicas XLA runs as threads of one process each count apart)."""
        found: dict[str, list[dict[str, Any]]] = {}
        for path in sorted((self.out / "trace").glob("trace-*.jsonl")):
            for line in path.read_text().splitlines():
                if line:
                    event = json.loads(line)
                    found.setdefault(f"{event['pid']}/{event['thread']}", []).append(event)
        return found


def start_job(
    harness: Harness, launch: Launch, scenarios: list[str], out: Path, batch_size: int = 4
) -> Any:
    """Start the kit's job for ``launch`` (one process per node for ``"nodes"``)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "trace").mkdir(exist_ok=True)
    spec = {"flags": dict(launch.flags), "batch_size": batch_size, "out": str(out)}
    spec["scenarios"] = scenarios
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    job = ["-m", "cardcage.testing.job", str(spec_path)]
    env = harness.env(**{TRACE: str(out / "trace")}, **launch.env)
    world = launch.world_size
    if launch.command == "torchrun":
        torchrun = str(Path(PYTHON).parent / "torchrun")
        command = [torchrun, "--standalone", f"--nproc-per-node={world}", *job]
        return [harness.start(command, env, "torchrun")]
    if launch.command == "horovodrun":
        horovodrun = str(Path(PYTHON).parent / "horovodrun")
        command = [horovodrun, "-np", str(world), "-H", f"localhost:{world}", PYTHON, *job]
        return [harness.start(command, env, "horovodrun")]
    if launch.command in ("nodes", "ranks"):
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = str(sock.getsockname()[1])
        meet = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        if launch.command == "nodes":
            return [
                harness.start([PYTHON, *job], {**env, **meet, "NODE_RANK": str(n)}, f"node {n}")
                for n in range(world)
            ]
        return [
            harness.start(
                [PYTHON, *job],
                {**env, **meet, **{k: v.format(rank=r) for k, v in launch.env.items()}},
                f"rank {r}",
            )
            for r in range(world)
        ]
    return [harness.start([PYTHON, *job], env, "python")]


def run_job(
    harness: Harness, launch: Launch, scenarios: list[str], out: Path, batch_size: int = 4
) -> JobOutput:
    """Run the job to its end; what it left, with its exit status and output."""
    runs = start_job(harness, launch, scenarios, out, batch_size)
    codes = [run.wait() for run in runs]
    output = "\n".join(
        f"=== {run.name} (exit {code})\n{run.output()}"
        for run, code in zip(runs, codes, strict=True)
    )
    return JobOutput(launch, harness, out, max(codes, key=abs), output)


class SuiteBase:
    """What a backend declares to the suite (see :class:`~cardcage.testing.BackendSuite`).

    Class attributes:
        backend: the backend's canonical name.
        plugin: its entry-point name (default: ``backend``).
        launches: ``{name: Launch}``, how its jobs are started; every multi-process backend
            names at least one launch with ``world_size > 1``.
        requires_cuda: skip the training checks, with the reason, where CUDA is missing.
        skip: ``{check or scenario: reason}`` for what this backend does not support.
        tolerance: how close to the plain loop's weights (absolute, per weight).
        batch_size: the per-process batch size of the job.
        sharded_optimizer_state: ``True`` for a backend that shards the optimizer state
            (fsdp): every training process must hold less than the whole per-parameter
            state after each fit (a DTensor counts with its local shard), and all of them
            together at least the whole.
        resume_world_sizes: ``{name: (saves, resumes)}``, two launches of different world
            sizes: a job of ``saves`` trains one epoch and saves, a job of ``resumes``
            resumes that checkpoint for two more, and both must match a plain loop whose
            world size changes there. For a backend whose checkpoints resume on any number
            of processes.
    """

    backend: ClassVar[str]
    plugin: ClassVar[str | None] = None
    launches: ClassVar[dict[str, Launch]] = {}
    requires_cuda: ClassVar[bool] = False
    skip: ClassVar[dict[str, str]] = {}
    tolerance: ClassVar[float] = 1e-5
    batch_size: ClassVar[int] = 4
    sharded_optimizer_state: ClassVar[bool] = False
    resume_world_sizes: ClassVar[dict[str, tuple[Launch, Launch]]] = {}

    # -- helpers -------------------------------------------------------------------------------

    @classmethod
    def entry_point(cls) -> str:
        return cls.plugin or cls.backend

    def skip_unsupported(self, *checks: str) -> None:
        for check in checks:
            if check in self.skip:
                pytest.skip(self.skip[check])

    @classmethod
    def need_training(cls) -> None:
        if cls.requires_cuda and not torch.cuda.is_available():
            pytest.skip(f"{cls.backend} trains on CUDA GPUs: torch.cuda.is_available() is False")

    def close(self, value: list[float], expected: list[float], what: str) -> None:
        assert len(value) == len(expected), (
            f"{what}: {len(value)} weights, {len(expected)} expected"
        )
        worst = max(abs(a - b) for a, b in zip(value, expected, strict=True))
        assert worst <= self.tolerance, (
            f"{what}: {self.backend} differs from the plain PyTorch loop by {worst:.3g} "
            f"(tolerance {self.tolerance})"
        )
