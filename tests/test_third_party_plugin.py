"""A third-party backend, packaged and pip-installed for real, works like a built-in one.

A session fixture writes throwaway distributions (hatchling, an entry point in the group
``cardcage``) into a temporary directory and installs them with
``pip install --no-deps --target``. Every check then runs ``python -m cardcage`` or a small
script in a fresh process with that directory on ``PYTHONPATH``, where
``importlib.metadata`` finds the installed distributions; the test environment itself is
never modified.

Distributions:

- ``cardcage-foo`` (entry point ``foo``): backend ``foo``, alias ``foo_alias``, one rule of
  order 650 (``FOO_CLUSTER=1``), available only when ``FOO_AVAILABLE=1``.
- ``cardcage-broken`` (``broken``): its module raises ImportError when imported.
- ``cardcage-invalid`` (``invalid``): ``cardcage_accelerators()`` returns a string.
- In separate directories, so they do not break every other check: ``cardcage-dupe-cpu``
  (a backend named ``cpu``), ``cardcage-dupe-spawn`` (alias ``spawn``), and
  ``cardcage-cpu-fork`` (a second distribution with the entry point name ``cpu``).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import plugin_install
import pytest
from plugin_install import describe, pip_install

pytestmark = pytest.mark.slow

FOO_VERSION = "0.3.1"
BROKEN_MESSAGE = "cardcage_broken needs libfoo.so.7, which is not installed"
FOO_REASON = "no Foo cluster controller answered (FOO_AVAILABLE is not 1)"

STEERING_PREFIXES = (*plugin_install.STEERING_PREFIXES, "FOO_")
STEERING_NAMES = plugin_install.STEERING_NAMES

FOO_MODULE = f'''
"""A third-party cardcage backend for a made-up "Foo" cluster."""

import cardcage
from cardcage import Accelerator, Availability, Rule


class FooAccelerator(cardcage.Accelerator):
    name = "foo"
    aliases = ("foo_alias",)
    rules = (
        Rule(
            order=650,
            when=lambda ctx: ctx.env.get("FOO_CLUSTER") == "1",
            why="running on a Foo cluster",
        ),
    )

    @classmethod
    def availability(cls, ctx):
        if ctx.env.get("FOO_AVAILABLE") == "1":
            return Availability(True, "Foo controller answered")
        return Availability(False, {FOO_REASON!r}, "export FOO_AVAILABLE=1")

    def setup(self, trainer):
        pass

    def train(self, trainer):
        return None


@cardcage.hookimpl
def cardcage_accelerators():
    return [FooAccelerator]
'''

BROKEN_MODULE = f"""
raise ImportError({BROKEN_MESSAGE!r})
"""

INVALID_MODULE = """
import cardcage


@cardcage.hookimpl
def cardcage_accelerators():
    return ["not an accelerator"]
"""


def _backend_module(name: str, aliases: tuple[str, ...]) -> str:
    return f"""
import cardcage
from cardcage import Accelerator, Rule


class Impostor(Accelerator):
    name = {name!r}
    aliases = {aliases!r}
    rules = (Rule(order=700, when=lambda ctx: False, why="never"),)


@cardcage.hookimpl
def cardcage_accelerators():
    return [Impostor]
"""


@dataclass(frozen=True)
class Dist:
    name: str  # distribution name
    entry_point: str
    module: str  # import name
    source: str
    version: str = "0.1.0"


MAIN_DISTS = (
    Dist("cardcage-foo", "foo", "cardcage_foo", FOO_MODULE, FOO_VERSION),
    Dist("cardcage-broken", "broken", "cardcage_broken", BROKEN_MODULE),
    Dist("cardcage-invalid", "invalid", "cardcage_invalid", INVALID_MODULE),
)
DUPE_DISTS = (
    Dist("cardcage-dupe-cpu", "dupecpu", "cardcage_dupecpu", _backend_module("cpu", ())),
    Dist(
        "cardcage-dupe-spawn",
        "dupespawn",
        "cardcage_dupespawn",
        _backend_module("dupe", ("spawn",)),
    ),
)
FORK_DISTS = (
    Dist("cardcage-cpu-fork", "cpu", "cardcage_cpu_fork", _backend_module("cpu_fork", ())),
)


def write_dist(root: Path, dist: Dist) -> Path:
    """A source tree for ``dist``, built by hatchling."""
    folder = root / dist.name
    folder.mkdir(parents=True)
    (folder / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [build-system]
            requires = ["hatchling>=1.18"]
            build-backend = "hatchling.build"

            [project]
            name = "{dist.name}"
            version = "{dist.version}"
            description = "A throwaway cardcage plugin written by cardcage's tests."
            requires-python = ">=3.10"

            [project.entry-points.cardcage]
            {dist.entry_point} = "{dist.module}"

            [tool.hatch.build.targets.wheel]
            only-include = ["{dist.module}.py"]
            """
        )
    )
    (folder / f"{dist.module}.py").write_text(dist.source.lstrip())
    return folder


@dataclass(frozen=True)
class Sites:
    main: Path  # foo, broken, invalid
    dupes: Path  # dupecpu, dupespawn
    fork: Path  # a second "cpu" entry point


@pytest.fixture(scope="session")
def sites(tmp_path_factory: pytest.TempPathFactory) -> Sites:
    root = tmp_path_factory.mktemp("third_party_plugins")
    found = Sites(root / "site-main", root / "site-dupes", root / "site-fork")
    for target, dists in zip(
        (found.main, found.dupes, found.fork), (MAIN_DISTS, DUPE_DISTS, FORK_DISTS), strict=True
    ):
        sources = [write_dist(root / "src", dist) for dist in dists]
        pip_install(target, sources, "the test plugins")
        for dist in dists:
            assert (target / f"{dist.module}.py").is_file()
            info = target / f"{dist.name.replace('-', '_')}-{dist.version}.dist-info"
            assert f"{dist.entry_point} = {dist.module}" in (info / "entry_points.txt").read_text()
    return found


def child_env(paths: Sequence[Path], **extra: str) -> dict[str, str]:
    """The parent's environment without anything that steers plugins or selection."""
    return plugin_install.child_env(paths, STEERING_PREFIXES, STEERING_NAMES, **extra)


def run(args: Sequence[str], env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    """``python <args>`` in a neutral directory (``-m`` and ``-c`` put it on ``sys.path``)."""
    cwd = Path(env["PYTHONPATH"].split(os.pathsep)[0]).parent
    return plugin_install.run_python(args, cwd, env, timeout=180)


def cardcage(
    sites: Sequence[Path], *args: str, status: int = 0, **env: str
) -> subprocess.CompletedProcess[str]:
    result = run(["-m", "cardcage", *args], child_env(sites, **env))
    assert result.returncode == status, describe(result)
    assert "Traceback" not in result.stderr, describe(result)
    return result


def cardcage_json(sites: Sequence[Path], *args: str, **env: str) -> Any:
    result = cardcage(sites, *args, "--json", **env)
    return json.loads(result.stdout)


def trace_by_accelerator(selection: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    grouped: dict[str, list[dict[str, Any]]] = {}
    for entry in selection["trace"]:
        grouped.setdefault(entry["accelerator"], []).append(entry)
    return grouped


def test_discovered_with_distribution_and_version(sites: Sites) -> None:
    listing = cardcage_json([sites.main], "plugins")
    rows = {row["name"]: row for row in listing["backends"]}
    foo = rows["foo"]
    assert foo["distribution"] == "cardcage-foo"
    assert foo["version"] == FOO_VERSION
    assert foo["plugin"] == "foo"
    assert foo["aliases"] == ["foo_alias"]
    assert foo["rules"] == [{"order": 650, "name": None, "why": "running on a Foo cluster"}]
    assert foo["available"] is False
    assert foo["reason"] == FOO_REASON
    # found exactly the way the shipped backends are
    assert rows["cpu"]["distribution"] == "cardcage-cpu"
    records = {record["name"]: record for record in listing["plugins"]}
    assert records["foo"]["status"] == "loaded"
    assert records["foo"]["module"] == "cardcage_foo"
    assert records["foo"]["distribution"] == "cardcage-foo"
    assert records["foo"]["version"] == FOO_VERSION
    assert records["foo"]["accelerators"] == ["foo"]

    available = cardcage_json([sites.main], "plugins", FOO_AVAILABLE="1")
    assert {row["name"]: row for row in available["backends"]}["foo"]["available"] is True

    text = cardcage([sites.main], "plugins").stdout
    assert f"foo (aliases: foo_alias)  [cardcage-foo {FOO_VERSION}]" in text


def test_alias_selects_the_backend(sites: Sites) -> None:
    selection = cardcage_json([sites.main], "explain", "--backend", "foo_alias", FOO_AVAILABLE="1")
    assert selection["accelerator"] == "foo"
    assert selection["requested"] == "foo"
    assert selection["rule"] == "distributed_backend"
    assert selection["why"].startswith("distributed_backend=") and "was named" in selection["why"]
    assert {e["outcome"] for e in selection["trace"]} == {"not evaluated"}

    # named but unavailable: exit 2 with the plugin's own reason and hint
    result = cardcage([sites.main], "explain", "--backend", "foo_alias", status=2)
    assert "'foo_alias' selects 'foo', which is not available here" in result.stderr
    assert FOO_REASON in result.stderr
    assert "export FOO_AVAILABLE=1" in result.stderr


def test_rule_slots_in_before_the_cpu_fallback(sites: Sites) -> None:
    selection = cardcage_json([sites.main], "explain", FOO_CLUSTER="1", FOO_AVAILABLE="1")
    assert selection["accelerator"] == "foo"
    assert selection["rule"] == "foo.650"
    assert selection["why"] == "running on a Foo cluster"

    trace = selection["trace"]
    orders = [entry["order"] for entry in trace]
    assert orders == sorted(orders)
    assert [e["order"] for e in trace if e["accelerator"] == "foo"] == [650]
    decided = next(i for i, e in enumerate(trace) if e["outcome"] == "claimed")
    assert trace[decided]["rule"] == "foo.650"
    before, after = trace[:decided], trace[decided + 1 :]
    assert before and all(e["order"] <= 600 for e in before)
    assert {e["outcome"] for e in before} == {"not claimed"}
    # gpu's single_gpu rule (600) is evaluated before foo's 650 ...
    assert {"order": 600, "accelerator": "gpu", "outcome": "not claimed"}.items() <= next(
        e for e in before if e["accelerator"] == "gpu"
    ).items()
    # ... and the cpu fallback (1000) after it is never reached
    assert [(e["accelerator"], e["order"], e["outcome"]) for e in after] == [
        ("cpu", 1000, "not evaluated")
    ]

    text = cardcage([sites.main], "explain", FOO_CLUSTER="1", FOO_AVAILABLE="1").stdout
    assert text.splitlines()[0] == "selected 'foo' by foo.650: running on a Foo cluster"
    assert any(line.startswith(" ->   650  foo") for line in text.splitlines())

    # Without the Foo cluster the rule does not claim and the CPU fallback decides.
    plain = cardcage_json([sites.main], "explain", FOO_AVAILABLE="1")
    assert plain["accelerator"] == "cpu"
    assert trace_by_accelerator(plain)["foo"][0]["outcome"] == "not claimed"


def test_rule_does_not_beat_the_single_gpu_rule(sites: Sites) -> None:
    """With one GPU (torch.cuda patched, as docs/choosing-a-backend.md allows) gpu's 600 decides
    first."""
    script = textwrap.dedent(
        """\
        import json
        import torch
        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: 1
        import cardcage
        print(json.dumps(cardcage.select(gpus=1).as_dict()))
        """
    )
    env = child_env([sites.main], FOO_CLUSTER="1", FOO_AVAILABLE="1")
    result = run(["-c", script], env)
    assert result.returncode == 0, describe(result)
    selection = json.loads(result.stdout)
    assert selection["accelerator"] == "gpu", selection
    assert selection["rule"] == "single_gpu"
    foo = trace_by_accelerator(selection)["foo"]
    assert [(e["order"], e["outcome"]) for e in foo] == [(650, "not evaluated")]


def test_unavailable_backend_is_skipped_with_its_reason(sites: Sites) -> None:
    selection = cardcage_json([sites.main], "explain", FOO_CLUSTER="1")
    assert selection["accelerator"] == "cpu"
    assert selection["rule"] == "cpu_fallback"
    (foo,) = trace_by_accelerator(selection)["foo"]
    assert foo["outcome"] == "unavailable"
    assert foo["detail"] == FOO_REASON
    assert trace_by_accelerator(selection)["cpu"][0]["outcome"] == "claimed"

    text = cardcage([sites.main], "explain", FOO_CLUSTER="1").stdout
    (line,) = [line for line in text.splitlines() if " foo " in line]
    assert "unavailable" in line
    assert f"running on a Foo cluster ({FOO_REASON})" in line


def test_disabled_by_entry_point_name(sites: Sites) -> None:
    listing = cardcage_json([sites.main], "plugins", CARDCAGE_DISABLE_PLUGINS="foo")
    assert "foo" not in {row["name"] for row in listing["backends"]}
    assert "cpu" in {row["name"] for row in listing["backends"]}
    records = {record["name"]: record for record in listing["plugins"]}
    assert records["foo"]["status"] == "disabled"
    assert records["foo"]["distribution"] == "cardcage-foo"

    selection = cardcage_json(
        [sites.main],
        "explain",
        CARDCAGE_DISABLE_PLUGINS="foo",
        FOO_CLUSTER="1",
        FOO_AVAILABLE="1",
    )
    assert selection["accelerator"] == "cpu"
    assert "foo" not in {e["accelerator"] for e in selection["trace"]}

    for name in ("foo", "foo_alias"):
        result = cardcage(
            [sites.main],
            "explain",
            "--backend",
            name,
            status=2,
            CARDCAGE_DISABLE_PLUGINS="foo",
            FOO_AVAILABLE="1",
        )
        assert f"distributed_backend={name!r} is not an installed backend" in result.stderr
        assert "Installed: " in result.stderr
        assert result.stdout == ""


def test_autoload_off_loads_only_the_named_plugins(sites: Sites) -> None:
    env = {"CARDCAGE_PLUGINS_AUTOLOAD": "0", "CARDCAGE_PLUGINS": "cpu,foo"}
    listing = cardcage_json([sites.main], "plugins", **env)
    assert sorted(row["name"] for row in listing["backends"]) == ["cpu", "foo"]
    status = {record["name"]: record["status"] for record in listing["plugins"]}
    assert status.pop("cpu") == "loaded"
    assert status.pop("foo") == "loaded"
    # Every other installed plugin (the shipped backends, cardcage-submit), and the site's
    # broken ones: not even imported, so not failed.
    installed = {ep.name for ep in importlib.metadata.entry_points(group="cardcage")}
    expected_others = (installed - {"cpu"}) | {"broken", "invalid"}
    assert {"ddp", "fsdp", "horovod", "tpu"} <= expected_others
    assert status == dict.fromkeys(expected_others, "not autoloaded")

    text = cardcage([sites.main], "plugins", **env).stdout
    assert "broken [cardcage-broken 0.1.0]  not autoloaded" in text
    assert "ImportError" not in text

    selection = cardcage_json([sites.main], "explain", FOO_CLUSTER="1", FOO_AVAILABLE="1", **env)
    assert selection["accelerator"] == "foo"
    assert sorted({e["accelerator"] for e in selection["trace"]}) == ["cpu", "foo"]


def test_broken_plugins_are_isolated_and_listed(sites: Sites) -> None:
    listing = cardcage_json([sites.main], "plugins")
    records = {record["name"]: record for record in listing["plugins"]}
    broken = records["broken"]
    assert broken["status"] == "failed"
    assert broken["distribution"] == "cardcage-broken"
    assert broken["error"] == f"ImportError: {BROKEN_MESSAGE}"
    invalid = records["invalid"]
    assert invalid["status"] == "failed"
    assert "cardcage_accelerators() returned 'not an accelerator'" in invalid["error"]
    assert invalid["error"].startswith("TypeError: ")
    names = {row["name"] for row in listing["backends"]}
    assert {
        "cpu",
        "ddp",
        "ddp2",
        "ddp_spawn",
        "dp",
        "gpu",
        "horovod",
        "tpu",
        "fsdp",
        "foo",
    } <= names

    result = cardcage([sites.main], "plugins")
    assert result.stderr == ""
    backends, _, not_loaded = result.stdout.partition("plugins not loaded:")
    for name in ("cpu", "ddp", "foo", "tpu"):
        assert f"\n  {name}" in backends
    assert f"broken [cardcage-broken 0.1.0]  failed: ImportError: {BROKEN_MESSAGE}" in not_loaded
    assert "invalid [cardcage-invalid 0.1.0]  failed: TypeError: " in not_loaded

    # selection goes on without them
    selection = cardcage_json([sites.main], "explain", FOO_CLUSTER="1", FOO_AVAILABLE="1")
    assert selection["accelerator"] == "foo"


def test_strict_mode_turns_a_broken_plugin_into_an_error(sites: Sites) -> None:
    for command in (["plugins"], ["explain", "--json"]):
        result = cardcage([sites.main], *command, status=2, CARDCAGE_STRICT_PLUGINS="1")
        assert result.stdout == ""
        assert result.stderr.startswith("cardcage: error: ")
        assert "'broken' (cardcage-broken) failed" in result.stderr
        assert BROKEN_MESSAGE in result.stderr
        assert "CARDCAGE_STRICT_PLUGINS" in result.stderr

    # disabling the broken plugins makes strict mode pass; invalid is the next one named
    result = cardcage(
        [sites.main], "plugins", status=2, CARDCAGE_STRICT_PLUGINS="1",
        CARDCAGE_DISABLE_PLUGINS="broken",
    )  # fmt: skip
    assert "'invalid' (cardcage-invalid) failed" in result.stderr
    cardcage(
        [sites.main],
        "plugins",
        CARDCAGE_STRICT_PLUGINS="1",
        CARDCAGE_DISABLE_PLUGINS="broken,invalid",
    )


@pytest.mark.parametrize(
    ("label", "plugin", "dist", "other_plugin", "other_dist", "disable"),
    [
        ("cpu", "cpu", "cardcage-cpu", "dupecpu", "cardcage-dupe-cpu", "dupespawn"),
        ("spawn", "dupespawn", "cardcage-dupe-spawn", "spawn", "cardcage-spawn", "dupecpu"),
    ],
)
def test_duplicate_backend_name_names_both_distributions(
    sites: Sites,
    label: str,
    plugin: str,
    dist: str,
    other_plugin: str,
    other_dist: str,
    disable: str,
) -> None:
    for command in (["plugins"], ["explain", "--backend", label]):
        result = cardcage([sites.dupes], *command, status=2, CARDCAGE_DISABLE_PLUGINS=disable)
        assert result.stdout == ""
        message = result.stderr
        assert message.startswith("cardcage: error: ")
        assert f"backend name {label!r} is claimed by two plugins" in message
        assert f"{plugin} ({dist})" in message
        assert f"{other_plugin} ({other_dist})" in message
        assert "CARDCAGE_DISABLE_PLUGINS" in message

    # the way out the message names
    cardcage([sites.dupes], "plugins", CARDCAGE_DISABLE_PLUGINS=f"{disable},dupecpu,dupespawn")


def test_duplicate_entry_point_name_names_both_distributions(sites: Sites) -> None:
    result = cardcage([sites.fork], "plugins", status=2)
    assert result.stdout == ""
    message = result.stderr
    assert "two distributions register the cardcage plugin 'cpu'" in message
    assert "cardcage-cpu-fork" in message
    assert "cardcage-cpu " in message or "cardcage-cpu." in message
