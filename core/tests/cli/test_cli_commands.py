"""Commands that plugins add to ``cardcage`` (the ``cardcage_cli_commands`` hook), clashes
between them, and the message for a known command whose distribution is missing."""

from __future__ import annotations

import argparse
import json
import types
from collections.abc import Callable

import pytest

import cardcage
from cardcage import PluginError
from cardcage.cli import main as cli
from cardcage.cli.main import missing_command_message
from cardcage.plugins.commands import Commands

Register = Callable[[object, str], None]


def commands_plugin(name: str, *commands: str) -> types.ModuleType:
    """An in-process plugin adding ``commands``; each prints its name and ``--who``."""
    module = types.ModuleType(name)

    def run(args: argparse.Namespace) -> int:
        print(f"{args.command} says hello to {args.who}")
        return 3

    def arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--who", default="nobody")

    def cardcage_cli_commands(commands: Commands) -> None:
        for command in commands_:
            commands.add(command, run, help=f"the {command} command", arguments=arguments)

    commands_ = commands
    module.cardcage_cli_commands = cardcage.hookimpl(cardcage_cli_commands)  # type: ignore[attr-defined]
    return module


@pytest.fixture(autouse=True)
def no_plugin_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CARDCAGE_DISABLE_PLUGINS", "CARDCAGE_PLUGINS_AUTOLOAD", "CARDCAGE_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("CARDCAGE_STRICT_PLUGINS", raising=False)


def test_a_plugin_adds_a_command(
    inprocess_plugins: Register, capsys: pytest.CaptureFixture[str]
) -> None:
    inprocess_plugins(commands_plugin("greeter", "hello"), "greeter")
    assert cli.main(["hello", "--who", "you"]) == 3
    assert capsys.readouterr().out == "hello says hello to you\n"

    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "the hello command" in capsys.readouterr().out

    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "other plugins (no backend):" in out
    assert "  greeter  loaded  commands: hello" in out.splitlines()
    assert cli.main(["plugins", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    (entry,) = [c for c in document["commands"] if c["name"] == "hello"]
    assert entry == {
        "name": "hello",
        "plugin": "greeter",
        "distribution": None,
        "help": "the hello command",
    }


def test_the_core_names_no_plugin_command() -> None:
    assert set(cli.COMMANDS) == {"plugins", "explain", "env", "demo", "new-plugin"}


def test_a_command_clashing_with_a_builtin_is_refused(
    inprocess_plugins: Register, capsys: pytest.CaptureFixture[str]
) -> None:
    inprocess_plugins(commands_plugin("shadow", "explain"), "shadow")
    with pytest.raises(PluginError) as raised:
        cli.all_commands()
    message = str(raised.value)
    assert "'cardcage explain'" in message
    assert "cardcage itself (a built-in command)" in message
    assert "plugin 'shadow' (registered in-process)" in message

    assert cli.main(["env"]) == 2  # every command refuses: the clash is named, on one line
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("cardcage: error: the command 'cardcage explain'")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


def test_two_plugins_with_one_command_are_refused_naming_both(
    inprocess_plugins: Register,
) -> None:
    inprocess_plugins(commands_plugin("alpha", "hello"), "alpha")
    inprocess_plugins(commands_plugin("beta", "bye", "hello"), "beta")
    with pytest.raises(PluginError, match="'cardcage hello' is registered twice") as raised:
        cli.all_commands()
    assert "plugin 'alpha' (registered in-process)" in str(raised.value)
    assert "plugin 'beta' (registered in-process)" in str(raised.value)


def test_a_bad_command_name_is_refused(inprocess_plugins: Register) -> None:
    inprocess_plugins(commands_plugin("loud", "Hello World"), "loud")
    with pytest.raises(PluginError, match=r"plugin 'loud' .* registers the command 'Hello World'"):
        cli.all_commands()


def test_a_failing_hook_names_the_plugin(inprocess_plugins: Register) -> None:
    module = types.ModuleType("broken")

    def cardcage_cli_commands(commands: Commands) -> None:
        raise RuntimeError("boom")

    module.cardcage_cli_commands = cardcage.hookimpl(cardcage_cli_commands)  # type: ignore[attr-defined]
    inprocess_plugins(module, "broken")
    with pytest.raises(PluginError, match=r"plugin 'broken' .* RuntimeError: boom"):
        cli.all_commands()


def test_a_missing_known_command_names_the_install_command() -> None:
    message = missing_command_message("submit", [])
    assert message == (
        "'cardcage submit' needs cardcage-submit, which is not installed: "
        "pip install 'cardcage[submit]'"
    )
    assert missing_command_message("frobnicate", []) is None


def test_a_disabled_extension_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CARDCAGE_DISABLE_PLUGINS", "submit")
    assert cli.main(["submit", "train.py", "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    if "installed but disabled" in captured.err:  # cardcage-submit is installed
        assert "cardcage-submit" in captured.err
    else:
        assert "pip install 'cardcage[submit]'" in captured.err
