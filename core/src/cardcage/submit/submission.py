"""Submitting a grid: one job per point, each in its own folder, through submitit
(:func:`submit`), or only the jobs it would submit with their sbatch scripts (:func:`dry_run`)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cardcage.errors import MisconfigurationError
from cardcage.submit.external import SubmissionError, _submitit
from cardcage.submit.files import MANIFEST, POINT_FILE, _json_safe, _write_json
from cardcage.submit.grid import Value, _describe, _point_folder_name, expand_grid
from cardcage.submit.jobs import Grid, GridJob
from cardcage.submit.plan import Plan, SlurmJob
from cardcage.submit.run import _run_point
from cardcage.submit.sbatch import _sbatch_script, _setup_lines
from cardcage.submit.target import GridPoint, Target


@dataclass(frozen=True)
class PlannedJob:
    """One job of a grid before submission: its folder and exact sbatch script."""

    index: int
    hparams: dict[str, Value]
    folder: Path
    script: str
    parameters: dict[str, Any]
    point: GridPoint = field(repr=False)


def _default_folder(job_name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path.cwd() / "cardcage-jobs" / f"{job_name}-{stamp}"
    folder, number = base, 1
    while folder.exists():
        number += 1
        folder = base.with_name(f"{base.name}-{number}")
    return folder


def _points(
    plan: Plan,
    target: str | Callable[..., Any],
    grid: Mapping[str, Sequence[Value] | Value] | Sequence[Mapping[str, Value]] | None,
    folder: str | os.PathLike[str] | None,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
) -> tuple[Path, list[GridPoint]]:
    resolved = Target.of(target)
    hparams_list = expand_grid(grid)
    extra = dict(kwargs or {})
    if resolved.kind == "script":
        if extra:
            raise MisconfigurationError(
                f"kwargs={extra!r} cannot be passed to a script ({resolved.spec}); pass "
                "command-line arguments with args=[...] (after -- on the command line)."
            )
        if any(not isinstance(arg, (str, int, float)) for arg in args):
            raise MisconfigurationError(
                f"args={list(args)!r}: a script gets command-line arguments, strings or "
                "numbers only."
            )
    clash = sorted(set(extra) & set().union(*(set(p) for p in hparams_list)))
    if clash:
        raise MisconfigurationError(
            f"{clash[0]!r} is both a grid hyperparameter and in kwargs. Keep it in one place."
        )
    root = (
        Path(folder).expanduser().resolve()
        if folder is not None
        else _default_folder(plan.job.job_name)
    )
    if (root / MANIFEST).exists():
        raise MisconfigurationError(
            f"folder={str(root)!r} (--folder) already holds a submitted grid ({MANIFEST}). "
            "Give a new folder, or leave it out for a new one under ./cardcage-jobs."
        )
    if "%" in str(root):
        raise MisconfigurationError(
            f"folder={str(root)!r} (--folder) contains '%', which SLURM and submitit read as "
            "a pattern (%j: the job id). Choose a folder without it."
        )
    points = [
        GridPoint(
            index=index,
            count=len(hparams_list),
            hparams=hparams,
            folder=str(root / _point_folder_name(index, hparams)),
            target=resolved,
            args=tuple(args),
            kwargs=extra,
            requeue_signal=plan.requeue_signal,
        )
        for index, hparams in enumerate(hparams_list)
    ]
    return root, points


def dry_run(
    target: str | Callable[..., Any],
    job: SlurmJob | None = None,
    grid: Mapping[str, Sequence[Value] | Value] | Sequence[Mapping[str, Value]] | None = None,
    *,
    folder: str | os.PathLike[str] | None = None,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
) -> list[PlannedJob]:
    """The jobs :func:`submit` would submit, each with its exact sbatch script; submits none,
    writes nothing."""
    plan = (job or SlurmJob()).plan()
    _root, points = _points(plan, target, grid, folder, args, kwargs)
    planned = []
    for point in points:
        script, parameters = _sbatch_script(plan, point)
        planned.append(
            PlannedJob(point.index, point.hparams, Path(point.folder), script, parameters, point)
        )
    return planned


def submit(
    target: str | Callable[..., Any],
    job: SlurmJob | None = None,
    grid: Mapping[str, Sequence[Value] | Value] | Sequence[Mapping[str, Value]] | None = None,
    *,
    folder: str | os.PathLike[str] | None = None,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
) -> Grid:
    """Submit ``target`` once per grid point, each job as ``job`` describes; the :class:`Grid`.

    Args:
        target: what every task of each job runs: a function (called as
            ``target(*args, **kwargs, **hparams)``; rank 0's return value is the job's
            result), ``"module:function"``, ``"path/to/file.py:function"``, or a script
            ``"path/to/train.py"`` (run as ``__main__`` with ``args`` and ``--NAME=VALUE``
            per hyperparameter).
        job: the resources and Trainer flags (default: 1 node, 1 CPU process, 60 minutes).
        grid: ``{"lr": [1e-3, 1e-2], "layers": [16, 32]}``: one job per combination.
        folder: where the grid's folders go (on a file system every node sees); default
            ``./cardcage-jobs/<job_name>-<date>-<time>``.

    Inside the job, :func:`current_run` gives the point (``run.trainer()`` builds the
    Trainer with the submitted flags). Raises :class:`~cardcage.MisconfigurationError` for
    a bad description (nothing is submitted), :class:`SubmissionError` when sbatch fails
    (the jobs submitted until then stay in the manifest).
    """
    plan = (job or SlurmJob()).plan()
    root, points = _points(plan, target, grid, folder, args, kwargs)
    submitit = _submitit()
    if submitit.SlurmExecutor.affinity() < 0:
        raise SubmissionError(
            "cannot submit to SLURM from here: `srun` is not on PATH (not a SLURM login node?). "
            "`cardcage submit --dry-run` prints the scripts without submitting."
        )
    root.mkdir(parents=True, exist_ok=True)
    grid_ = Grid(root, [], _manifest_plan(plan))
    for point in points:
        Path(point.folder).mkdir(parents=True, exist_ok=True)
        _write_json(Path(point.folder) / POINT_FILE, point.record(plan))
        grid_.jobs.append(GridJob(point.index, point.hparams, Path(point.folder), None, plan.tasks))
    grid_.save()
    for point, grid_job in zip(points, grid_.jobs, strict=True):
        executor = submitit.SlurmExecutor(folder=point.folder, python=plan.job.python)
        parameters = {**plan.parameters, "setup": _setup_lines(plan, point)}
        executor.update_parameters(**parameters)
        try:
            submitted = executor.submit(_run_point, point)
        except Exception as error:
            grid_.save()
            raise SubmissionError(
                f"sbatch failed for job {point.index + 1} of {len(points)} "
                f"({_describe(point.hparams)}): {str(error).strip()}"
            ) from None
        grid_job.job_id = str(submitted.job_id)
        _write_json(Path(point.folder) / POINT_FILE, point.record(plan, grid_job.job_id))
        grid_.save()
    return grid_


def _manifest_plan(plan: Plan) -> dict[str, Any]:
    job = plan.job
    return {
        "accelerator": plan.accelerator,
        "rule": plan.rule,
        "nodes": job.nodes,
        "processes_per_node": plan.processes_per_node,
        "gpus_per_node": job.gpus_per_node,
        "job_name": job.job_name,
        "time_min": plan.time_min,
        "requeue_signal": plan.requeue_signal,
        "trainer_flags": _json_safe(plan.trainer_flags),
    }
