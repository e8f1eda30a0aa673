"""Submitting a grid: one job per point, each in its own folder, through submitit
(:func:`submit`), or only the jobs it would submit with their sbatch scripts (:func:`dry_run`);
:class:`SlurmJob`, the job description (:class:`~cardcage_submit.plan.JobDescription`) with
``dry_run`` and ``submit`` methods."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cardcage.sdk import MisconfigurationError
from cardcage_submit.external import SubmissionError, _submitit
from cardcage_submit.files import MANIFEST, POINT_FILE, _json_safe, _write_json
from cardcage_submit.grid import Value, _describe, _point_folder_name, expand_grid
from cardcage_submit.jobs import Grid, GridJob
from cardcage_submit.plan import JobDescription, Plan
from cardcage_submit.run import _run_point
from cardcage_submit.sbatch import _sbatch_script, _setup_lines
from cardcage_submit.target import GridPoint, Target


@dataclass(frozen=True)
class PlannedJob:
    """One job of a grid before submission: its folder and exact sbatch script."""

    index: int
    hparams: dict[str, Value]
    folder: Path
    script: str
    parameters: dict[str, Any]
    point: GridPoint = field(repr=False)


@dataclass
class SlurmJob(JobDescription):
    """What one job of a grid asks SLURM for, and the Trainer flags it trains with.

    The seed's ``SlurmCluster`` as a description: ``nodes`` and ``gpus_per_node`` per
    experiment, ``modules`` to load, ``setup`` commands (``export NCCL_DEBUG=INFO``), the
    ``job_name`` squeue shows. ``--ntasks-per-node`` is not set here: it is the number of
    processes per node the selection rules pick for ``trainer`` (the Trainer flags), on a
    node with ``gpus_per_node`` GPUs.

    Attributes:
        nodes: nodes per job (``--nodes``); the Trainer's ``num_nodes``.
        gpus_per_node: GPUs per node (``--gpus-per-node``); the Trainer's ``gpus`` when that
            is not set. 0: a CPU job.
        time: the time limit: minutes, or a SLURM time such as ``"02:00:00"``.
        partition: ``--partition``; None: the cluster's default.
        job_name: what squeue shows (not ``bash`` or ``interactive``: cardcage would take
            the job for an interactive shell).
        modules: ``module load`` lines, in order.
        setup: shell lines run before the training starts (after the modules).
        env: variables exported to the job.
        master_port: the rendezvous port; None: 15000 + the last four digits of the job id
            (distinct for jobs that run at the same time).
        cpus_per_task, mem: ``--cpus-per-task``, ``--mem`` (e.g. ``"32G"``).
        requeue: checkpoint and requeue before the time limit (``--requeue`` and
            ``--signal=SIG@signal_delay_s``); see docs/slurm.md.
        requeue_signal: the signal that asks for it (cardcage's default: USR1).
        signal_delay_s: seconds before the time limit that the signal comes.
        sbatch: any other sbatch option: ``{"account": "proj", "exclusive": True,
            "gres": "gpu:8"}`` (with ``gres``, ``--gpus-per-node`` is left out).
        srun_args: extra ``srun`` arguments; the default ends the whole step when one task
            fails (the other ranks would wait in a collective until a timeout).
        python: the interpreter command in the job; None: this one (``sys.executable``).
        trainer: the Trainer flags (``num_processes``, ``distributed_backend``,
            ``precision``, ``max_epochs``, ...). The job's function gets them from
            :func:`current_run` (``run.trainer()`` builds the Trainer).
    """

    def dry_run(
        self,
        target: str | Callable[..., Any],
        grid: Mapping[str, Sequence[Value] | Value] | Sequence[Mapping[str, Value]] | None = None,
        *,
        folder: str | os.PathLike[str] | None = None,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[PlannedJob]:
        """The jobs :meth:`submit` would submit, with their exact sbatch scripts; submits none."""
        return dry_run(target, self, grid, folder=folder, args=args, kwargs=kwargs)

    def submit(
        self,
        target: str | Callable[..., Any],
        grid: Mapping[str, Sequence[Value] | Value] | Sequence[Mapping[str, Value]] | None = None,
        *,
        folder: str | os.PathLike[str] | None = None,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Grid:
        """Submit one job per grid point; see :func:`submit`."""
        return submit(target, self, grid, folder=folder, args=args, kwargs=kwargs)


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
    job: JobDescription | None = None,
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
    job: JobDescription | None = None,
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
