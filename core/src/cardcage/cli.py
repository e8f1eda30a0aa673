"""The ``cardcage`` command: ``plugins``, ``explain``, ``env``, ``demo``, ``new-plugin``,
``submit`` and ``jobs``.

A bad flag or configuration prints the message on stderr and exits with status 2, without a
traceback. ``--json`` prints one JSON document on stdout and nothing else there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from cardcage.errors import MisconfigurationError, PluginError

EXIT_USAGE = 2
Command = Callable[[argparse.Namespace], int]


def _int_or_ids(value: str) -> int | str:
    """``"2"`` → 2 (a count), ``"1,3"`` or ``"3,"`` → the string (ids), as Lightning's CLI did."""
    text = value.strip()
    if "," in text:
        return text
    try:
        return int(text)
    except ValueError:
        return text  # validation names the flag and value


def _precision(value: str) -> int | str:
    return int(value) if value.isdigit() else value


def add_trainer_flags(parser: argparse.ArgumentParser) -> None:
    """The Trainer flags, spelled the way DESIGN.md's command line spells them."""
    group = parser.add_argument_group("trainer flags")
    group.add_argument(
        "--gpus",
        type=_int_or_ids,
        default=None,
        help="GPU count (2), all (-1), or ids ('1,3' or '3,')",
    )
    group.add_argument(
        "--tpu-cores", type=_int_or_ids, default=None, help="1, 8, or one core as 'k,'"
    )
    group.add_argument("--num-processes", type=int, default=1)
    group.add_argument("--num-nodes", type=int, default=1)
    group.add_argument(
        "--distributed-backend",
        "--backend",
        dest="distributed_backend",
        default=None,
        help="a backend name or alias; default: the rules decide",
    )
    group.add_argument("--auto-select-gpus", action="store_true")
    group.add_argument("--precision", type=_precision, default=32, help="32, 16, 64 or bf16")
    group.add_argument("--max-epochs", type=int, default=None)
    group.add_argument("--max-steps", type=int, default=None)


def trainer_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The Trainer keyword arguments held by ``args``."""
    names = (
        "gpus",
        "tpu_cores",
        "num_processes",
        "num_nodes",
        "distributed_backend",
        "auto_select_gpus",
        "precision",
        "max_epochs",
        "max_steps",
    )
    return {name: getattr(args, name) for name in names}


def _print_json(data: object) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")


def cmd_plugins(args: argparse.Namespace) -> int:
    from cardcage.report import backend_rows

    rows, records = backend_rows(os.environ)
    if args.json:
        _print_json({"backends": rows, "plugins": records})
        return 0
    print("backends:")
    for row in rows:
        aliases = f" (aliases: {', '.join(row['aliases'])})" if row["aliases"] else ""
        dist = f"{row['distribution']} {row['version']}" if row["distribution"] else row["plugin"]
        print(f"  {row['name']}{aliases}  [{dist}]  {row['status']}")
    others = [r for r in records if r["status"] != "loaded"]
    if others:
        print("plugins not loaded:")
        for record in others:
            error = f": {record['error']}" if record["error"] else ""
            dist = (
                f" [{record['distribution']} {record['version']}]" if record["distribution"] else ""
            )
            print(f"  {record['name']}{dist}  {record['status']}{error}")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from cardcage.selection import select

    selection = select(**trainer_flags(args))
    if args.json:
        _print_json(selection.as_dict())
    else:
        print(selection.explain())
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    from cardcage.report import environment_report

    report = environment_report(os.environ)
    if args.json:
        _print_json(report)
        return 0
    for section, values in report.items():
        print(f"{section}:")
        for key, value in values.items():
            print(f"  {key}: {value}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from cardcage.demo import run

    return run(trainer_flags(args), progress_bar=args.progress_bar)


def add_new_plugin_arguments(parser: argparse.ArgumentParser) -> None:
    from cardcage.scaffold import DEFAULT_ORDER

    parser.add_argument("name", metavar="NAME", help="the backend name, e.g. acme or my_npu")
    parser.add_argument(
        "--directory", default=None, help="where to write it (default: ./cardcage-NAME)"
    )
    parser.add_argument(
        "--order",
        type=int,
        default=DEFAULT_ORDER,
        help=f"the order of the backend's rule (default: {DEFAULT_ORDER})",
    )
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="a backend of one torch.distributed rank per process (default: one process)",
    )


def cmd_new_plugin(args: argparse.Namespace) -> int:
    from cardcage.scaffold import new_plugin

    names, folder, files = new_plugin(args.name, args.directory, args.order, args.distributed)
    print(f"created {names.distribution} in {folder}: {', '.join(files)}")
    print("next:")
    print(f"  pip install -e {folder}")
    print("  cardcage plugins")
    print(f"  {names.switch}=1 cardcage explain")
    print(f"  pytest {folder / 'tests'}")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from cardcage.submit import run_submit_command

    return run_submit_command(args)


def cmd_jobs(args: argparse.Namespace) -> int:
    from cardcage.submit import run_jobs_command

    return run_jobs_command(args)


COMMANDS: dict[str, tuple[Command, str]] = {
    "plugins": (cmd_plugins, "list backends, their plugins and whether they can run here"),
    "explain": (cmd_explain, "show which backend the flags select here, and why"),
    "env": (cmd_env, "versions, devices and cluster environment, for bug reports"),
    "demo": (cmd_demo, "train a small built-in model on synthetic data on the selected backend"),
    "new-plugin": (cmd_new_plugin, "write a new backend plugin distribution to start from"),
    "submit": (cmd_submit, "submit training to SLURM: one job per grid point (submitit)"),
    "jobs": (cmd_jobs, "status, results and cancellation of a submitted grid"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cardcage", description="Train PyTorch models on whichever accelerator fits."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (function, text) in COMMANDS.items():
        command = sub.add_parser(name, help=text, description=text)
        command.set_defaults(function=function)
        if name in ("plugins", "explain", "env"):
            command.add_argument(
                "--json", action="store_true", help="print one JSON document on stdout"
            )
        if name in ("explain", "demo"):
            add_trainer_flags(command)
        if name == "demo":
            command.add_argument(
                "--progress-bar",
                action=argparse.BooleanOptionalAction,
                default=True,
                help="show the progress bar (default: on)",
            )
        if name == "new-plugin":
            add_new_plugin_arguments(command)
        if name == "submit":
            from cardcage.submit import add_submit_arguments

            add_submit_arguments(command)
        if name == "jobs":
            from cardcage.submit import add_jobs_arguments

            add_jobs_arguments(command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.function(args))
    except (MisconfigurationError, PluginError) as error:
        print(f"cardcage: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `cardcage explain | head`: the reader left, which is no error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that flushing at exit raises nothing
        return 141  # 128 + SIGPIPE, as a program killed by the signal reports
