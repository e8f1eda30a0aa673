"""Submitting training to SLURM from Python or the command line: one job per grid point.

The distribution ``cardcage-submit`` (``pip install 'cardcage[submit]'``), an extension of
cardcage: found through the entry-point group ``cardcage`` like a backend plugin, it
registers no backend, only the commands ``cardcage submit`` and ``cardcage jobs`` (the
``cardcage_cli_commands`` hook). ``cardcage.SlurmJob`` is :class:`SlurmJob` from here.

Built on submitit, which writes each job's sbatch
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
imports it. Loading the plugin (which every process that selects a backend does) imports
this module alone: the names below and the commands' code are imported on first use.

The package's modules, each with one job:

- :mod:`~cardcage_submit.grid`: hyperparameter values and the grid's expansion into points;
- :mod:`~cardcage_submit.plan`: the job description (:class:`JobDescription`, the fields of
  :class:`SlurmJob`) and its validated layout (:class:`Plan`) from the selection rules;
- :mod:`~cardcage_submit.target`: what each job runs (:class:`Target`) and the grid point
  pickled into it (:class:`GridPoint`);
- :mod:`~cardcage_submit.run`: inside the job: :class:`Run`, :func:`current_run`, the
  function submitit calls in every task, the signals taken back from submitit;
- :mod:`~cardcage_submit.sbatch`: the sbatch script, as submitit writes it;
- :mod:`~cardcage_submit.submission`: :class:`SlurmJob` (the description with ``dry_run``
  and ``submit`` methods), :func:`submit` and :func:`dry_run`;
- :mod:`~cardcage_submit.jobs`: a submitted grid: :class:`Grid`, :class:`GridJob`,
  :class:`GridResult`, :func:`job_states`, cancellation;
- :mod:`~cardcage_submit.files`: the grid folder's file names and JSON writing;
- :mod:`~cardcage_submit.external`: submitit's lazy import, SLURM's commands,
  :class:`SubmissionError`;
- :mod:`~cardcage_submit.cli`: ``cardcage submit`` and ``cardcage jobs``.
"""

from __future__ import annotations

import argparse
import importlib
from typing import TYPE_CHECKING, Any

import cardcage

if TYPE_CHECKING:
    from cardcage.sdk import Commands
    from cardcage_submit.cli import add_jobs_arguments as add_jobs_arguments
    from cardcage_submit.cli import add_submit_arguments as add_submit_arguments
    from cardcage_submit.cli import job_from_arguments as job_from_arguments
    from cardcage_submit.cli import run_jobs_command as run_jobs_command
    from cardcage_submit.cli import run_submit_command as run_submit_command
    from cardcage_submit.external import SUBMITIT_REQUIREMENT as SUBMITIT_REQUIREMENT
    from cardcage_submit.external import SubmissionError as SubmissionError
    from cardcage_submit.files import MANIFEST as MANIFEST
    from cardcage_submit.files import POINT_FILE as POINT_FILE
    from cardcage_submit.files import RESULT_FILE as RESULT_FILE
    from cardcage_submit.grid import Value as Value
    from cardcage_submit.grid import expand_grid as expand_grid
    from cardcage_submit.grid import parse_grid_option as parse_grid_option
    from cardcage_submit.grid import parse_value as parse_value
    from cardcage_submit.jobs import TERMINAL_STATES as TERMINAL_STATES
    from cardcage_submit.jobs import Grid as Grid
    from cardcage_submit.jobs import GridJob as GridJob
    from cardcage_submit.jobs import GridResult as GridResult
    from cardcage_submit.jobs import job_states as job_states
    from cardcage_submit.plan import RESERVED_SBATCH as RESERVED_SBATCH
    from cardcage_submit.plan import JobDescription as JobDescription
    from cardcage_submit.plan import Plan as Plan
    from cardcage_submit.plan import parse_time as parse_time
    from cardcage_submit.run import RUN_VARIABLE as RUN_VARIABLE
    from cardcage_submit.run import Run as Run
    from cardcage_submit.run import current_run as current_run
    from cardcage_submit.submission import PlannedJob as PlannedJob
    from cardcage_submit.submission import SlurmJob as SlurmJob
    from cardcage_submit.submission import dry_run as dry_run
    from cardcage_submit.submission import submit as submit
    from cardcage_submit.target import GridPoint as GridPoint
    from cardcage_submit.target import Target as Target

# The package's names, imported from their modules on first use (PEP 562).
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(
        (
            "add_jobs_arguments",
            "add_submit_arguments",
            "job_from_arguments",
            "run_jobs_command",
            "run_submit_command",
        ),
        "cli",
    ),
    **dict.fromkeys(("SUBMITIT_REQUIREMENT", "SubmissionError"), "external"),
    **dict.fromkeys(("MANIFEST", "POINT_FILE", "RESULT_FILE"), "files"),
    **dict.fromkeys(("Value", "expand_grid", "parse_grid_option", "parse_value"), "grid"),
    **dict.fromkeys(("TERMINAL_STATES", "Grid", "GridJob", "GridResult", "job_states"), "jobs"),
    **dict.fromkeys(("RESERVED_SBATCH", "JobDescription", "Plan", "parse_time"), "plan"),
    **dict.fromkeys(("RUN_VARIABLE", "Run", "current_run"), "run"),
    **dict.fromkeys(("PlannedJob", "SlurmJob", "dry_run", "submit"), "submission"),
    **dict.fromkeys(("GridPoint", "Target"), "target"),
}

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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cardcage_submit' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"cardcage_submit.{module}"), name)
    globals()[name] = value
    return value


# -- the commands (the cardcage_cli_commands hook) ---------------------------------------------
# The hook runs whenever `cardcage` builds its parser; these wrappers import the commands'
# code only when `cardcage submit` or `cardcage jobs` is the command given.


def _add_submit_arguments(parser: argparse.ArgumentParser) -> None:
    from cardcage_submit.cli import add_submit_arguments

    add_submit_arguments(parser)


def _run_submit(args: argparse.Namespace) -> int:
    from cardcage_submit.cli import run_submit_command

    return run_submit_command(args)


def _add_jobs_arguments(parser: argparse.ArgumentParser) -> None:
    from cardcage_submit.cli import add_jobs_arguments

    add_jobs_arguments(parser)


def _run_jobs(args: argparse.Namespace) -> int:
    from cardcage_submit.cli import run_jobs_command

    return run_jobs_command(args)


@cardcage.hookimpl
def cardcage_cli_commands(commands: Commands) -> None:
    """``cardcage submit`` and ``cardcage jobs``."""
    commands.add(
        "submit",
        _run_submit,
        help="submit training to SLURM: one job per grid point (submitit)",
        arguments=_add_submit_arguments,
    )
    commands.add(
        "jobs",
        _run_jobs,
        help="status, results and cancellation of a submitted grid",
        arguments=_add_jobs_arguments,
    )
