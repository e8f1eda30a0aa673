"""Submitting training to SLURM from Python or the command line: one job per grid point.

Built on submitit (``pip install 'cardcage[submit]'``), which writes each job's sbatch
script, pickles the function and its arguments, runs it in every task with
``srun ... python -m submitit.core._submit FOLDER`` and pickles each task's return value.
cardcage adds what training jobs need on top of it:

- ``--ntasks-per-node`` is the number of processes per node the selection rules pick for the
  Trainer flags (the GPUs of a node for ``ddp``, 1 for ``ddp2``, ``num_processes`` on the
  CPU), checked against what the Trainer inside the job will see: SLURM manages the tasks
  (``SLURM_NTASKS`` equals the world size), so each process takes its ranks from SLURM;
- checkpoint-and-requeue: ``--requeue`` and ``--signal=USR1@90`` (cardcage's requeue signal,
  exported to the job as ``CARDCAGE_REQUEUE_SIGNAL``), and submitit's own signal handlers
  are taken out of the way so that cardcage's handler alone acts (see docs/submitting.md);
- a rendezvous port per job (``MASTER_PORT`` = 15000 + the last four digits of the job id),
  modules to load and setup commands;
- a grid search: one job per combination of hyperparameters, each in its own folder with its
  logs, the hyperparameters it ran with (``hparams.json``) and its result (``result.json``
  and submitit's result pickles), and a manifest (``grid.json``) from which
  :meth:`Grid.load` (or ``cardcage jobs FOLDER``) finds the jobs again: status through
  ``squeue``/``scontrol``/``sacct``, results, cancellation through ``scancel``.

submitit is imported only when a job is planned or submitted: ``import cardcage`` never
imports it.

The package's modules, each with one job:

- :mod:`~cardcage.submit.grid`: hyperparameter values and the grid's expansion into points;
- :mod:`~cardcage.submit.plan`: the job description (:class:`SlurmJob`) and its validated
  layout (:class:`Plan`) from the selection rules;
- :mod:`~cardcage.submit.target`: what each job runs (:class:`Target`) and the grid point
  pickled into it (:class:`GridPoint`);
- :mod:`~cardcage.submit.run`: inside the job: :class:`Run`, :func:`current_run`, the
  function submitit calls in every task, the signals taken back from submitit;
- :mod:`~cardcage.submit.sbatch`: the sbatch script, as submitit writes it;
- :mod:`~cardcage.submit.submission`: :func:`submit` and :func:`dry_run`;
- :mod:`~cardcage.submit.jobs`: a submitted grid: :class:`Grid`, :class:`GridJob`,
  :class:`GridResult`, :func:`job_states`, cancellation;
- :mod:`~cardcage.submit.files`: the grid folder's file names and JSON writing;
- :mod:`~cardcage.submit.external`: submitit's lazy import, SLURM's commands,
  :class:`SubmissionError`;
- :mod:`~cardcage.submit.cli`: ``cardcage submit`` and ``cardcage jobs``.
"""

from __future__ import annotations

from cardcage.submit.cli import add_jobs_arguments as add_jobs_arguments
from cardcage.submit.cli import add_submit_arguments as add_submit_arguments
from cardcage.submit.cli import job_from_arguments as job_from_arguments
from cardcage.submit.cli import run_jobs_command as run_jobs_command
from cardcage.submit.cli import run_submit_command as run_submit_command
from cardcage.submit.external import SUBMITIT_REQUIREMENT as SUBMITIT_REQUIREMENT
from cardcage.submit.external import SubmissionError
from cardcage.submit.files import MANIFEST as MANIFEST
from cardcage.submit.files import POINT_FILE as POINT_FILE
from cardcage.submit.files import RESULT_FILE as RESULT_FILE
from cardcage.submit.grid import Value as Value
from cardcage.submit.grid import expand_grid, parse_grid_option
from cardcage.submit.grid import parse_value as parse_value
from cardcage.submit.jobs import TERMINAL_STATES as TERMINAL_STATES
from cardcage.submit.jobs import Grid, GridJob, GridResult
from cardcage.submit.jobs import job_states as job_states
from cardcage.submit.plan import RESERVED_SBATCH as RESERVED_SBATCH
from cardcage.submit.plan import Plan as Plan
from cardcage.submit.plan import SlurmJob
from cardcage.submit.plan import parse_time as parse_time
from cardcage.submit.run import RUN_VARIABLE as RUN_VARIABLE
from cardcage.submit.run import Run, current_run
from cardcage.submit.run import _run_point as _run_point  # jobs pickled before the split
from cardcage.submit.submission import PlannedJob, dry_run, submit
from cardcage.submit.target import GridPoint as GridPoint
from cardcage.submit.target import Target as Target

__all__ = [
    "Grid",
    "GridJob",
    "GridResult",
    "PlannedJob",
    "Run",
    "SlurmJob",
    "SubmissionError",
    "current_run",
    "dry_run",
    "expand_grid",
    "parse_grid_option",
    "submit",
]
