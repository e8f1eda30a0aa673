"""The command line: ``cardcage submit`` (its options, the :class:`SlurmJob` they describe,
submitting or a dry run) and ``cardcage jobs`` (states, results, ``--cancel``, ``--wait``)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from typing import Any

from cardcage.sdk import Flags, MisconfigurationError, add_trainer_flags, trainer_flags
from cardcage_submit.external import SubmissionError
from cardcage_submit.grid import Value, _describe, parse_grid_option
from cardcage_submit.jobs import Grid
from cardcage_submit.submission import SlurmJob, _manifest_plan, dry_run, submit


def _submit_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("SLURM job (one per grid point)")
    group.add_argument("--nodes", type=int, default=None, help="nodes per job (num_nodes)")
    group.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node")
    group.add_argument("--time", default=None, help="time limit: minutes or [D-]HH:MM:SS")
    group.add_argument("--partition", default=None)
    group.add_argument("--job-name", default=None, help="what squeue shows (default cardcage)")
    group.add_argument("--module", action="append", default=None, help="module load (repeat)")
    group.add_argument(
        "--setup", action="append", default=None, help="a shell line before training (repeat)"
    )
    group.add_argument("--env", action="append", default=None, help="NAME=VALUE to export")
    group.add_argument("--master-port", type=int, default=None)
    group.add_argument("--cpus-per-task", type=int, default=None)
    group.add_argument("--mem", default=None, help="e.g. 32G")
    group.add_argument(
        "--sbatch",
        action="append",
        default=None,
        metavar="OPTION[=VALUE]",
        help="any other sbatch option, e.g. account=proj or exclusive (repeat)",
    )
    group.add_argument(
        "--no-requeue",
        dest="requeue",
        action="store_false",
        default=None,
        help="no checkpoint-and-requeue before the time limit",
    )
    group.add_argument("--requeue-signal", default=None, help="default USR1")
    group.add_argument("--signal-delay-s", type=int, default=None, help="default 90")
    group.add_argument("--python", default=None, help="interpreter command in the job")
    group = parser.add_argument_group("grid")
    group.add_argument(
        "--grid",
        action="append",
        default=None,
        metavar="NAME=V1,V2",
        help="one hyperparameter's values (repeat: every combination is a job)",
    )
    group.add_argument("--folder", default=None, help="default ./cardcage-jobs/NAME-DATE-TIME")
    group.add_argument(
        "--dry-run", action="store_true", default=None, help="print the sbatch scripts only"
    )
    group.add_argument("--json", action="store_true", default=None, help="print JSON on stdout")


def add_submit_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``cardcage submit`` arguments (options may come before or after the target)."""
    _submit_options(parser)
    add_trainer_flags(parser)
    parser.add_argument(
        "target", help="train.py (a script), module:function or path/to/file.py:function"
    )
    parser.add_argument(
        "rest", nargs=argparse.REMAINDER, help="more options; after --: the script's arguments"
    )


def _options_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cardcage submit", add_help=False)
    _submit_options(parser)
    add_trainer_flags(parser)
    return parser


def _pairs(values: Sequence[str] | None, option: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for text in values or ():
        name, equals, value = text.partition("=")
        if not equals or not name.strip():
            raise MisconfigurationError(
                f"{option} {text!r} is not NAME=VALUE. Write it like {option} NCCL_DEBUG=INFO."
            )
        pairs[name.strip()] = value
    return pairs


def job_from_arguments(args: argparse.Namespace) -> SlurmJob:
    """The :class:`SlurmJob` that ``cardcage submit`` arguments describe."""
    defaults = Flags().as_dict()
    trainer = {
        name: value
        for name, value in trainer_flags(args).items()
        if value is not None and value != defaults.get(name)
    }
    nodes = args.nodes
    if nodes is None:
        nodes = trainer.get("num_nodes", 1)
    extras: dict[str, str | int | bool] = {}
    for text in args.sbatch or ():
        name, equals, value = text.partition("=")
        extras[name.strip()] = value if equals else True
    job = SlurmJob(nodes=nodes, trainer=trainer)
    settings = {
        "gpus_per_node": args.gpus_per_node,
        "time": args.time,
        "partition": args.partition,
        "job_name": args.job_name,
        "modules": args.module,
        "setup": args.setup,
        "master_port": args.master_port,
        "cpus_per_task": args.cpus_per_task,
        "mem": args.mem,
        "requeue": args.requeue,
        "requeue_signal": args.requeue_signal,
        "signal_delay_s": args.signal_delay_s,
        "python": args.python,
    }
    for name, value in settings.items():
        if value is not None:
            setattr(job, name, value)
    job.env = _pairs(args.env, "--env")
    job.sbatch = extras
    return job


def run_submit_command(args: argparse.Namespace) -> int:
    """``cardcage submit``: submit (or with ``--dry-run`` print) one job per grid point."""
    rest = list(args.rest)
    script_args: list[str] = []
    if "--" in rest:
        cut = rest.index("--")
        rest, script_args = rest[:cut], rest[cut + 1 :]
    if rest:
        _options_parser().parse_args(rest, namespace=args)
    grid: dict[str, list[Value]] = {}
    for text in args.grid or ():
        name, values = parse_grid_option(text)
        if name in grid:
            raise MisconfigurationError(
                f"--grid {text!r} repeats {name!r}. Give each hyperparameter once, with all "
                f"its values: --grid {name}=V1,V2."
            )
        grid[name] = values
    job = job_from_arguments(args)
    target = args.target
    if not target.endswith(".py") and script_args:
        raise MisconfigurationError(
            f"arguments after -- ({' '.join(script_args)}) go to a script, but {target!r} is a "
            "function. Make them grid values (--grid NAME=VALUE), or submit a script."
        )
    if args.dry_run:
        planned = dry_run(target, job, grid, folder=args.folder, args=script_args)
        plan = job.plan()
        if args.json:
            document = {
                "plan": _manifest_plan(plan),
                "jobs": [
                    {
                        "index": item.index,
                        "hparams": item.hparams,
                        "folder": str(item.folder),
                        "script": item.script,
                    }
                    for item in planned
                ],
            }
            sys.stdout.write(json.dumps(document, indent=2) + "\n")
            return 0
        print(f"# cardcage submit --dry-run: {len(planned)} job(s), {plan.describe()}")
        for warning in plan.warnings:
            print(f"# warning: {warning}")
        for item in planned:
            print(f"# ---- job {item.index + 1} of {len(planned)}: {_describe(item.hparams)}")
            print(f"# ---- folder {item.folder}")
            sys.stdout.write(item.script if item.script.endswith("\n") else item.script + "\n")
        return 0
    try:
        submitted = submit(target, job, grid, folder=args.folder, args=script_args)
    except SubmissionError as error:
        print(f"cardcage: error: {error}", file=sys.stderr)
        return 1
    if args.json:
        sys.stdout.write(json.dumps(_jobs_document(submitted, None), indent=2) + "\n")
        return 0
    for grid_job in submitted.jobs:
        print(
            f"submitted job {grid_job.job_id}: {_describe(grid_job.hparams)} -> {grid_job.folder}"
        )
    print(f"grid folder: {submitted.root}")
    print(f"status, results and cancel: cardcage jobs {shlex.quote(str(submitted.root))}")
    return 0


def add_jobs_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``cardcage jobs`` arguments."""
    parser.add_argument("folder", help="the grid folder `cardcage submit` printed")
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.add_argument("--cancel", action="store_true", help="scancel the jobs not yet ended")
    parser.add_argument(
        "--wait", action="store_true", help="wait until every job ended (exit 1 unless all ok)"
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds, with --wait")


def _jobs_document(grid: Grid, states: Sequence[str] | None) -> dict[str, Any]:
    jobs = []
    for index, job in enumerate(grid.jobs):
        recorded = job.recorded() or {}
        jobs.append(
            {
                "index": job.index,
                "job_id": job.job_id,
                "state": None if states is None else states[index],
                "hparams": job.hparams,
                "folder": str(job.folder),
                "result": recorded.get("result"),
                "log": None if job.job_id is None else str(job.log(0, "out")),
            }
        )
    return {"folder": str(grid.root), "plan": grid.plan, "jobs": jobs}


def run_jobs_command(args: argparse.Namespace) -> int:
    """``cardcage jobs FOLDER``: the grid's jobs, states and results; ``--cancel``, ``--wait``."""
    grid = Grid.load(args.folder)
    cancelled: list[str] = []
    if args.cancel:
        try:
            cancelled = grid.cancel()
        except SubmissionError as error:
            print(f"cardcage: error: {error}", file=sys.stderr)
            return 1
    if args.wait:
        try:
            states = grid.wait(args.timeout)
        except TimeoutError as error:
            print(f"cardcage: error: {error}", file=sys.stderr)
            return 1
    else:
        states = grid.states()
    document = _jobs_document(grid, states)
    document["cancelled"] = cancelled
    if args.json:
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
    else:
        plan = grid.plan
        print(
            f"grid {grid.root}: {len(grid.jobs)} job(s), {plan.get('accelerator')} on "
            f"{plan.get('nodes')} node(s) x {plan.get('processes_per_node')} process(es)"
        )
        rows = [("index", "job", "state", "hyperparameters", "result")]
        for entry in document["jobs"]:
            result = entry["result"]
            shown = "" if result is None else json.dumps(result)
            rows.append(
                (
                    str(entry["index"]),
                    str(entry["job_id"] or "-"),
                    str(entry["state"]),
                    _describe(entry["hparams"]),
                    shown if len(shown) <= 60 else shown[:57] + "...",
                )
            )
        widths = [max(len(row[column]) for row in rows) for column in range(4)]
        for row in rows:
            cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
            print("  ".join([*cells, row[4]]).rstrip())
        if cancelled:
            print(f"cancelled {len(cancelled)} job(s): {' '.join(cancelled)}")
    if args.wait and any(state != "COMPLETED" for state in states):
        return 1
    return 0
