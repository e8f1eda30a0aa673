"""Commands that plugins add to the ``cardcage`` command line.

A plugin adds a command by implementing the ``cardcage_cli_commands`` hook
(:mod:`cardcage.plugins.spec`) and calling :meth:`Commands.add` on the registrar it receives::

    @cardcage.hookimpl
    def cardcage_cli_commands(commands):
        commands.add("hello", run_hello, help="say hello", arguments=add_hello_arguments)

The core never names a plugin's command; :data:`KNOWN_COMMANDS` only says which distribution
to install when a command of a distribution that ships with cardcage is missing.

This module imports neither :mod:`cardcage.cli.main` nor any plugin, so a plugin's command module
may import it at module level.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from cardcage.errors import PluginError

#: What a command runs: the parsed arguments in, the exit status out.
Run = Callable[[argparse.Namespace], int]
#: What adds a command's arguments to its subparser.
Arguments = Callable[[argparse.ArgumentParser], None]

#: The commands of distributions that ship with cardcage but outside the core: command ->
#: (distribution, the command that installs it). For the message when one is missing only;
#: the core never imports them.
KNOWN_COMMANDS: dict[str, tuple[str, str]] = {
    "submit": ("cardcage-submit", "pip install 'cardcage[submit]'"),
    "jobs": ("cardcage-submit", "pip install 'cardcage[submit]'"),
}

_NAME_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_")


@dataclass(frozen=True)
class Command:
    """One subcommand of ``cardcage``: its name, what it runs and who registered it."""

    name: str
    run: Run
    help: str
    arguments: Arguments | None = None
    plugin: str = "cardcage"  # the entry-point (or in-process) name; "cardcage": built in
    distribution: str | None = "cardcage-core"

    def owner(self) -> str:
        """Who registered the command, for messages: ``plugin (distribution)``."""
        if self.plugin == "cardcage":
            return "cardcage itself (a built-in command)"
        return f"plugin {self.plugin!r} ({self.distribution or 'registered in-process'})"


class Commands:
    """The registrar the ``cardcage_cli_commands`` hook receives: :meth:`add` adds a command.

    A name already taken, by a built-in command or by another plugin, is refused with a
    :class:`~cardcage.PluginError` naming both.
    """

    def __init__(self, builtin: Iterable[Command] = ()) -> None:
        self._commands: dict[str, Command] = {command.name: command for command in builtin}
        self._plugin = "cardcage"
        self._distribution: str | None = "cardcage-core"

    def _registering(self, plugin: str, distribution: str | None) -> None:
        """Attribute the next :meth:`add` calls to ``plugin`` (the core calls this)."""
        self._plugin, self._distribution = plugin, distribution

    def add(self, name: str, run: Run, *, help: str, arguments: Arguments | None = None) -> None:
        """Add the command ``cardcage NAME``.

        :param name: the subcommand, lower case (letters, digits, ``-`` and ``_``).
        :param run: called with the parsed arguments; its return value is the exit status.
            A :class:`~cardcage.MisconfigurationError` or :class:`~cardcage.PluginError`
            it raises becomes one line on stderr and exit status 2.
        :param help: one line for ``cardcage --help`` and the command's own help.
        :param arguments: adds the command's arguments to its ``argparse`` subparser;
            :func:`add_trainer_flags` adds the Trainer flags as the core's commands spell them.
        """
        if not isinstance(name, str) or not name or not set(name) <= _NAME_CHARACTERS:
            raise PluginError(
                f"plugin {self._plugin!r} ({self._distribution or 'registered in-process'}) "
                f"registers the command {name!r}: a command name is lower-case letters, digits, "
                "'-' and '_'."
            )
        command = Command(name, run, help, arguments, self._plugin, self._distribution)
        other = self._commands.get(name)
        if other is not None:
            raise PluginError(
                f"the command 'cardcage {name}' is registered twice: by {other.owner()} and by "
                f"{command.owner()}. Uninstall one of the plugins, or disable it with "
                "CARDCAGE_DISABLE_PLUGINS=<name>."
            )
        self._commands[name] = command

    def __iter__(self) -> Iterator[Command]:
        return iter(self._commands.values())

    def __contains__(self, name: object) -> bool:
        return name in self._commands

    def get(self, name: str) -> Command | None:
        return self._commands.get(name)
