"""A submitted grid: its jobs (:class:`Grid`, :class:`GridJob`), found again from its
manifest; their states from ``squeue``/``scontrol``/``sacct`` (:func:`job_states`), their
results (:class:`GridResult`), cancellation through ``scancel``."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cardcage.sdk import MisconfigurationError
from cardcage_submit.external import SubmissionError, _slurm, _submitit
from cardcage_submit.files import MANIFEST, RESULT_FILE, _write_json
from cardcage_submit.grid import Value

#: The states after which a job never runs again.
TERMINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "REVOKED",
        "TIMEOUT",
    }
)


def job_states(job_ids: Sequence[str]) -> dict[str, str]:
    """SLURM's state of each job: ``squeue``, then ``scontrol show job`` (finished jobs the
    controller still remembers), then ``sacct`` (accounting, when the cluster has it).
    Jobs none of them knows are left out."""
    wanted = [job_id for job_id in job_ids if job_id]
    states: dict[str, str] = {}
    if not wanted:
        return states
    done = _slurm(["squeue", "-h", "-o", "%i %T", "-j", ",".join(wanted)])
    if done is not None and done.returncode == 0:
        for line in done.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] in wanted:
                states[parts[0]] = parts[1]
    for job_id in wanted:
        if job_id in states:
            continue
        shown = _slurm(["scontrol", "show", "job", "-o", job_id])
        if shown is not None and shown.returncode == 0:
            match = re.search(r"\bJobState=(\S+)", shown.stdout)
            if match:
                states[job_id] = match.group(1)
    missing = [job_id for job_id in wanted if job_id not in states]
    if missing:
        accounted = _slurm(
            ["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(missing)]
        )
        if accounted is not None and accounted.returncode == 0:
            for line in accounted.stdout.splitlines():
                job_id, _, state = line.partition("|")
                if job_id in missing and state:
                    states[job_id] = state.split()[0]
    return states


@dataclass
class GridResult:
    """What one job of a grid produced: ``value`` (rank 0's return value) or ``error``."""

    index: int
    hparams: dict[str, Value]
    job_id: str | None
    state: str
    value: Any = None
    error: str | None = None
    folder: Path | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class GridJob:
    """One submitted job of a grid."""

    index: int
    hparams: dict[str, Value]
    folder: Path
    job_id: str | None
    tasks: int = 1

    def _paths(self, task: int = 0) -> Any:
        from submitit.core.utils import JobPaths

        return JobPaths(self.folder, job_id=self.job_id, task_id=task)

    def log(self, task: int = 0, stream: str = "out") -> Path | None:
        """The path of a task's stdout (``"out"``) or stderr (``"err"``) log."""
        if self.job_id is None:
            return None
        _submitit()
        paths = self._paths(task)
        return Path(paths.stdout if stream == "out" else paths.stderr)

    def outcome(self, task: int = 0) -> tuple[str, Any] | None:
        """submitit's ``("success", value)`` or ``("error", traceback)`` for a task; None
        while there is none."""
        if self.job_id is None:
            return None
        _submitit()
        from submitit.core.utils import pickle_load

        path = Path(self._paths(task).result_pickle)
        if not path.exists():
            return None
        loaded = pickle_load(path)
        return (str(loaded[0]), loaded[1])

    def task_results(self) -> list[Any]:
        """Every task's return value (raises RuntimeError for a task without one)."""
        values = []
        for task in range(self.tasks):
            outcome = self.outcome(task)
            if outcome is None or outcome[0] != "success":
                raise RuntimeError(
                    f"job {self.job_id} task {task} has no result"
                    + (f":\n{outcome[1]}" if outcome else "")
                )
            values.append(outcome[1])
        return values

    def recorded(self) -> dict[str, Any] | None:
        """``result.json`` as rank 0 wrote it, if it did."""
        path = self.folder / RESULT_FILE
        if not path.exists():
            return None
        data: dict[str, Any] = json.loads(path.read_text())
        return data


class Grid:
    """A submitted grid: its jobs, their states and results; ``Grid.load(folder)`` finds it
    again in another process."""

    def __init__(self, root: Path, jobs: list[GridJob], plan: dict[str, Any]):
        self.root = root
        self.jobs = jobs
        self.plan = plan

    def __repr__(self) -> str:
        return f"Grid({str(self.root)!r}, {len(self.jobs)} job(s))"

    @property
    def job_ids(self) -> list[str]:
        return [job.job_id for job in self.jobs if job.job_id]

    def save(self) -> None:
        _write_json(
            self.root / MANIFEST,
            {
                "folder": str(self.root),
                "plan": self.plan,
                "jobs": [
                    {
                        "index": job.index,
                        "hparams": job.hparams,
                        "folder": str(job.folder),
                        "job_id": job.job_id,
                        "tasks": job.tasks,
                    }
                    for job in self.jobs
                ],
            },
        )

    @classmethod
    def load(cls, folder: str | os.PathLike[str]) -> Grid:
        """The grid submitted into ``folder`` (the folder ``submit`` printed)."""
        root = Path(folder).expanduser().resolve()
        manifest = root / MANIFEST
        if not manifest.is_file():
            raise MisconfigurationError(
                f"{str(root)!r} holds no submitted grid (no {MANIFEST}). Pass the folder that "
                "`cardcage submit` printed (or SlurmJob.submit's grid.root)."
            )
        data = json.loads(manifest.read_text())
        jobs = [
            GridJob(
                int(entry["index"]),
                dict(entry["hparams"]),
                Path(entry["folder"]),
                entry.get("job_id"),
                int(entry.get("tasks", 1)),
            )
            for entry in data["jobs"]
        ]
        return cls(root, jobs, dict(data.get("plan", {})))

    def states(self) -> list[str]:
        """Each job's state (``PENDING``, ``RUNNING``, ``COMPLETED``, ``FAILED``, ...).

        A job SLURM no longer knows is ``COMPLETED`` or ``FAILED`` from its result file,
        else ``UNKNOWN``; a job never submitted is ``NOT_SUBMITTED``.
        """
        known = job_states(self.job_ids)
        states = []
        for job in self.jobs:
            if job.job_id is None:
                states.append("NOT_SUBMITTED")
            elif job.job_id in known:
                states.append(known[job.job_id])
            else:
                outcome = job.outcome()
                states.append(
                    "UNKNOWN"
                    if outcome is None
                    else ("COMPLETED" if outcome[0] == "success" else "FAILED")
                )
        return states

    def done(self) -> bool:
        return all(state in TERMINAL_STATES or state == "NOT_SUBMITTED" for state in self.states())

    def wait(self, timeout: float | None = None, poll_s: float = 2.0) -> list[str]:
        """Wait until every job has ended; their final states (TimeoutError at ``timeout``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            states = self.states()
            if all(s in TERMINAL_STATES or s in ("NOT_SUBMITTED", "UNKNOWN") for s in states):
                return states
            if deadline is not None and time.monotonic() > deadline:
                pending = [
                    f"{job.job_id} {state}"
                    for job, state in zip(self.jobs, states, strict=True)
                    if state not in TERMINAL_STATES
                ]
                raise TimeoutError(f"jobs still running after {timeout}s: {', '.join(pending)}")
            time.sleep(poll_s)

    def results(self, *, wait: bool = True, timeout: float | None = None) -> list[GridResult]:
        """Each job's result (rank 0's return value), in grid order; waits for the jobs first
        unless ``wait=False``. A job that failed has ``error`` set, not ``value``."""
        states = self.wait(timeout) if wait else self.states()
        results = []
        for job, state in zip(self.jobs, states, strict=True):
            result = GridResult(job.index, job.hparams, job.job_id, state, folder=job.folder)
            outcome = job.outcome() if job.job_id else None
            if outcome is not None and outcome[0] == "success":
                result.value = outcome[1]
            elif outcome is not None:
                result.error = str(outcome[1])
            else:
                result.error = self._no_result(job, state)
            results.append(result)
        return results

    @staticmethod
    def _no_result(job: GridJob, state: str) -> str:
        if job.job_id is None:
            return "not submitted"
        message = f"job {job.job_id} is {state} and left no result"
        log = job.log(0, "err")
        if log is not None and log.exists():
            tail = log.read_text(errors="replace").splitlines()[-20:]
            message += f"; the end of {log}:\n" + "\n".join(tail)
        return message

    def cancel(self) -> list[str]:
        """``scancel`` every job that has not ended; the ids cancelled."""
        states = self.states()
        live = [
            job.job_id
            for job, state in zip(self.jobs, states, strict=True)
            if job.job_id and state not in TERMINAL_STATES and state != "UNKNOWN"
        ]
        if live:
            done = _slurm(["scancel", *live])
            if done is None or done.returncode != 0:
                said = "" if done is None else (done.stderr or done.stdout).strip()
                raise SubmissionError(f"scancel {' '.join(live)} failed: {said}")
        return live
