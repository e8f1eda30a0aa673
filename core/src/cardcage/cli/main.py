"""The ``cardcage`` command: ``plugins``, ``explain``, ``env``, ``demo``, ``new-plugin``, and
the commands plugins add through the ``cardcage_cli_commands`` hook
(:mod:`cardcage.plugins.commands`).

A bad flag or configuration prints the message on stderr and exits with status 2, without a
traceback. ``--json`` prints one JSON document on stdout and nothing else there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence

from cardcage.config.arguments import add_trainer_flags, trainer_flags
from cardcage.errors import MisconfigurationError, PluginError
from cardcage.plugins.commands import KNOWN_COMMANDS, Arguments, Command, Commands, Run
from cardcage.plugins.manager import PluginRecord, Registry

EXIT_USAGE = 2
#: ``cardcage plugins`` shows how long a backend's availability check took from this long on.
SHOWN_CHECK_S = 1.0


def collect(builtin: Iterable[Command], registry: Registry) -> Commands:
    """The built-in commands and those the loaded plugins of ``registry`` register.

    Each plugin's ``cardcage_cli_commands`` is called in turn (sorted by plugin name), so
    that every command is attributed to the plugin that added it.
    """
    commands = Commands(builtin)
    caller = getattr(registry.hooks, "cardcage_cli_commands", None)
    if caller is None:
        return commands
    distributions: Mapping[str, str | None] = {
        record.name: record.distribution for record in registry.plugins
    }
    implementations = [
        impl
        for impl in caller.get_hookimpls()
        if not (getattr(impl, "hookwrapper", False) or getattr(impl, "wrapper", False))
    ]
    for impl in sorted(implementations, key=lambda impl: impl.plugin_name):
        commands._registering(impl.plugin_name, distributions.get(impl.plugin_name))
        values = {"commands": commands}
        try:
            impl.function(*(values[name] for name in impl.argnames))
        except PluginError:
            raise
        except Exception as error:
            owner = distributions.get(impl.plugin_name) or "registered in-process"
            raise PluginError(
                f"plugin {impl.plugin_name!r} ({owner}) failed to add its commands: "
                f"{type(error).__name__}: {error}. Disable it with "
                f"CARDCAGE_DISABLE_PLUGINS={impl.plugin_name}."
            ) from error
    commands._registering("cardcage", "cardcage-core")
    return commands


def missing_command_message(name: str, plugin_records: Iterable[PluginRecord]) -> str | None:
    """Why ``cardcage NAME`` is not there and what installs it, for the known commands."""
    if name not in KNOWN_COMMANDS:
        return None
    distribution, install = KNOWN_COMMANDS[name]
    for record in plugin_records:
        if record.distribution == distribution and record.status != "loaded":
            why = f": {record.error}" if record.error else ""
            return (
                f"'cardcage {name}' comes from {distribution}, which is installed but "
                f"{record.status} (plugin {record.name!r}){why}."
            )
    return f"'cardcage {name}' needs {distribution}, which is not installed: {install}"


def _print_json(data: object) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")


def cmd_plugins(args: argparse.Namespace) -> int:
    from cardcage.cli.report import backend_rows

    rows, records = backend_rows(os.environ)
    added = [command for command in all_commands() if command.plugin != "cardcage"]
    if args.json:
        commands = [
            {"name": c.name, "plugin": c.plugin, "distribution": c.distribution, "help": c.help}
            for c in added
        ]
        _print_json({"backends": rows, "plugins": records, "commands": commands})
        return 0
    print("backends:")
    for row in rows:
        aliases = f" (aliases: {', '.join(row['aliases'])})" if row["aliases"] else ""
        dist = f"{row['distribution']} {row['version']}" if row["distribution"] else row["plugin"]
        took = row["check_seconds"]
        slow = f"  (availability check: {took:.1f} s)" if took >= SHOWN_CHECK_S else ""
        print(f"  {row['name']}{aliases}  [{dist}]  {row['status']}{slow}")
    extensions = [r for r in records if r["status"] == "loaded" and not r["accelerators"]]
    if extensions:
        print("other plugins (no backend):")
        for record in extensions:
            dist = (
                f" [{record['distribution']} {record['version']}]" if record["distribution"] else ""
            )
            names = [c.name for c in added if c.plugin == record["name"]]
            shown = f"  commands: {', '.join(names)}" if names else ""
            print(f"  {record['name']}{dist}  loaded{shown}")
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
    from cardcage.plugins.manager import slow_checks_named
    from cardcage.selection.engine import select

    with slow_checks_named():  # a slow availability check is named while it runs
        selection = select(**trainer_flags(args))
    if args.json:
        _print_json(selection.as_dict())
    else:
        print(selection.explain())
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    from cardcage.cli.report import environment_report

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
    from cardcage.cli.demo import run

    return run(trainer_flags(args), progress_bar=args.progress_bar)


def add_new_plugin_arguments(parser: argparse.ArgumentParser) -> None:
    from cardcage.cli.scaffold import DEFAULT_ORDER, DISTRIBUTED_ORDER

    parser.add_argument("name", metavar="NAME", help="the backend name, e.g. acme or my_npu")
    parser.add_argument(
        "--directory", default=None, help="where to write it (default: ./cardcage-NAME)"
    )
    parser.add_argument(
        "--order",
        type=int,
        default=None,
        help=f"the order of the backend's rule (default: {DEFAULT_ORDER}, or "
        f"{DISTRIBUTED_ORDER} with --distributed)",
    )
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="a backend of one torch.distributed rank per process (default: one process)",
    )


def cmd_new_plugin(args: argparse.Namespace) -> int:
    from cardcage.cli.scaffold import new_plugin

    names, folder, files = new_plugin(args.name, args.directory, args.order, args.distributed)
    print(f"created {names.distribution} in {folder}: {', '.join(files)}")
    print("next:")
    print(f"  pip install -e {folder}")
    print("  cardcage plugins")
    print(f"  {names.switch}=1 cardcage explain")
    print(f"  pytest {folder / 'tests'}")
    return 0


def _add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")


def _add_explain_arguments(parser: argparse.ArgumentParser) -> None:
    _add_json_flag(parser)
    add_trainer_flags(parser)


def _add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    add_trainer_flags(parser)
    parser.add_argument(
        "--progress-bar",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="show the progress bar (default: on)",
    )


#: The built-in commands: name -> (function, help). Plugins add theirs through the
#: ``cardcage_cli_commands`` hook.
COMMANDS: dict[str, tuple[Run, str]] = {
    "plugins": (cmd_plugins, "list backends, their plugins and whether they can run here"),
    "explain": (cmd_explain, "show which backend the flags select here, and why"),
    "env": (cmd_env, "versions, devices and cluster environment, for bug reports"),
    "demo": (cmd_demo, "train a small built-in model on synthetic data on the selected backend"),
    "new-plugin": (cmd_new_plugin, "write a new backend plugin distribution to start from"),
}
_ARGUMENTS: dict[str, Arguments] = {
    "plugins": _add_json_flag,
    "explain": _add_explain_arguments,
    "env": _add_json_flag,
    "demo": _add_demo_arguments,
    "new-plugin": add_new_plugin_arguments,
}


def builtin_commands() -> list[Command]:
    """The core's own commands."""
    return [
        Command(name, run, text, _ARGUMENTS.get(name)) for name, (run, text) in COMMANDS.items()
    ]


def all_commands(env: Mapping[str, str] | None = None) -> Commands:
    """The built-in commands and those the plugins loaded under ``env`` (default:
    ``os.environ``) register; raises :class:`~cardcage.PluginError` on a clash."""
    from cardcage.plugins import manager as plugins

    return collect(builtin_commands(), plugins.registry(os.environ if env is None else env))


def build_parser(
    commands: Commands | None = None, *, selected: str | None = None
) -> argparse.ArgumentParser:
    """The ``cardcage`` parser with ``commands`` (default: :func:`all_commands`).

    With ``selected``, only that command's arguments are added (the others are listed, with
    their help line): a plugin's argument code is imported only when its command runs.
    """
    if commands is None:
        commands = all_commands()
    parser = argparse.ArgumentParser(
        prog="cardcage", description="Train PyTorch models on whichever accelerator fits."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in commands:
        subparser = sub.add_parser(command.name, help=command.help, description=command.help)
        subparser.set_defaults(function=command.run)
        if command.arguments is not None and selected in (None, command.name):
            command.arguments(subparser)
    return parser


def _error(error: object) -> int:
    print(f"cardcage: error: {error}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else list(argv)
    try:
        commands = all_commands()
    except (MisconfigurationError, PluginError) as error:
        return _error(error)
    name = arguments[0] if arguments else None
    if name is not None and not name.startswith("-") and name not in commands:
        from cardcage.plugins import manager as plugins

        missing = missing_command_message(name, plugins.registry(os.environ).plugins)
        if missing is not None:
            return _error(missing)
    parser = build_parser(commands, selected=name or "")
    args = parser.parse_args(arguments)
    try:
        return int(args.function(args))
    except (MisconfigurationError, PluginError) as error:
        return _error(error)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `cardcage explain | head`: the reader left, which is no error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that flushing at exit raises nothing
        return 141  # 128 + SIGPIPE, as a program killed by the signal reports
