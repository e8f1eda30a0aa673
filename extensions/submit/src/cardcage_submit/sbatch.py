"""The sbatch script of a job, as submitit's ``SlurmExecutor`` writes it: cardcage's setup
lines (requeue signal, rendezvous port, environment, modules, setup commands) and the
interpreter that runs ``submitit.core._submit``."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cardcage.sdk import REQUEUE_SIGNAL
from cardcage_submit.external import _submitit
from cardcage_submit.grid import _describe

if TYPE_CHECKING:
    from cardcage_submit.plan import JobDescription, Plan
    from cardcage_submit.target import GridPoint


def _setup_lines(plan: Plan, point: GridPoint) -> list[str]:
    job = plan.job
    lines = [
        f"# cardcage: job {point.index + 1} of {point.count}: {_describe(point.hparams)}",
        f"# cardcage: {plan.describe()}",
    ]
    if plan.requeue_signal is not None:
        lines.append(f"export {REQUEUE_SIGNAL}={plan.requeue_signal}")
    else:
        lines.append(f"export {REQUEUE_SIGNAL}=none")
    lines.append(f"export CARDCAGE_REQUEUE_DIR={shlex.quote(point.folder)}")
    if job.master_port is not None:
        lines.append(f"export MASTER_PORT={job.master_port}")
    else:
        lines.append("export MASTER_PORT=$((15000 + SLURM_JOB_ID % 10000))")
    lines.extend(f"export {key}={shlex.quote(str(value))}" for key, value in job.env.items())
    lines.extend(f"module load {shlex.quote(module)}" for module in job.modules)
    lines.extend(job.setup)
    return lines


def _python_command(job: JobDescription) -> str:
    return shlex.quote(sys.executable) if job.python is None else job.python


def _sbatch_script(plan: Plan, point: GridPoint) -> tuple[str, dict[str, Any]]:
    """The script submitit's SlurmExecutor writes for ``point``, and its parameters."""
    _submitit()
    from submitit.slurm.slurm import _make_sbatch_string

    parameters = {**plan.parameters, "setup": _setup_lines(plan, point)}
    folder = Path(point.folder)
    # As SlurmExecutor._submitit_command_str builds it.
    command = " ".join(
        [_python_command(plan.job), "-u -m submitit.core._submit", shlex.quote(str(folder))]
    )
    return _make_sbatch_string(command=command, folder=folder, **parameters), parameters
