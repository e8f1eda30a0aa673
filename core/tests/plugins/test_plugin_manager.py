"""Loading plugins: in-process ones, broken ones, conflicts, and their place in selection."""

from __future__ import annotations

import functools
import importlib.util
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest

import cardcage
from cardcage import (
    Accelerator,
    Availability,
    MisconfigurationError,
    PluginError,
    Rule,
    SelectionContext,
    select,
)
from cardcage.environments.base import ClusterEnvironment
from cardcage.plugins import manager as plugins
from cardcage.plugins.manager import PluginManager

Register = Callable[[object, str], None]


def plugin_module(
    name: str,
    accelerators: Callable[[], list[Any]] | None = None,
    environments: Callable[[], list[Any]] | None = None,
) -> types.ModuleType:
    """An in-process plugin: a module with the hook functions given."""
    module = types.ModuleType(name)
    if accelerators is not None:
        module.cardcage_accelerators = cardcage.hookimpl(accelerators)  # type: ignore[attr-defined]
    if environments is not None:
        module.cardcage_cluster_environments = cardcage.hookimpl(environments)  # type: ignore[attr-defined]
    return module


class FooAccelerator(Accelerator):
    """The example backend of docs/plugins.md ("A complete plugin"): claims the job on a Foo
    cluster, between 500 and 600."""

    name = "foo"
    aliases = ("foo_alias",)
    rules = (
        Rule(
            order=550,
            when=lambda ctx: ctx.env.get("FOO_CLUSTER") == "1",
            why="running on a Foo cluster",
            name="foo_cluster",
        ),
    )
    available: ClassVar[bool] = True

    @classmethod
    def availability(cls, ctx: SelectionContext) -> Availability:
        if cls.available:
            return Availability(True)
        return Availability(False, "no Foo card in this machine", "plug in a Foo card")


class UnavailableFoo(FooAccelerator):
    available = False


def _raise(ctx: SelectionContext) -> bool:
    raise RuntimeError("the rule tripped over its own feet")


class BrokenRuleAccelerator(Accelerator):
    name = "broken_rule"
    rules = (Rule(order=150, when=_raise, why="a rule with a bug", name="buggy_rule"),)


@pytest.fixture
def foo(inprocess_plugins: Register) -> types.ModuleType:
    module = plugin_module("cardcage_foo", lambda: [FooAccelerator])
    inprocess_plugins(module, "foo")
    return module


# --- in-process registration -----------------------------------------------------------------


def test_in_process_backend_is_selectable_by_name_and_alias(
    foo: types.ModuleType, cuda_count_0: int
) -> None:
    registry = plugins.registry({})
    assert registry.accelerators["foo"].cls is FooAccelerator
    assert registry.accelerators["foo"].plugin == "foo"
    assert registry.accelerators["foo"].distribution is None
    assert registry.canonical("FOO_ALIAS") == "foo"
    assert select(env={}, distributed_backend="foo_alias").accelerator == "foo"
    (record,) = [r for r in registry.plugins if r.name == "foo"]
    assert (record.status, record.accelerators) == ("loaded", ("foo",))


def test_unregister_removes_the_backend(inprocess_plugins: Register, cuda_count_0: int) -> None:
    inprocess_plugins(plugin_module("cardcage_foo", lambda: [FooAccelerator]), "foo")
    assert "foo" in plugins.registry({}).accelerators
    plugins.unregister("foo")
    assert "foo" not in plugins.registry({}).accelerators
    with pytest.raises(MisconfigurationError, match="distributed_backend='foo' is not an"):
        select(env={}, distributed_backend="foo")


def test_a_rule_ordered_550_slots_in_before_gpu_and_cpu(
    foo: types.ModuleType, cuda_count_1: int
) -> None:
    on_foo = select(env={"FOO_CLUSTER": "1"}, gpus=1)
    assert (on_foo.accelerator, on_foo.rule, on_foo.why) == (
        "foo",
        "foo_cluster",
        "running on a Foo cluster",
    )
    names = [e.rule for e in on_foo.trace]
    assert names.index("cpu_processes") < names.index("foo_cluster") < names.index("single_gpu")
    assert select(env={}, gpus=1).accelerator == "gpu"  # not on a Foo cluster: unchanged


def test_an_unavailable_claiming_backend_is_skipped_with_its_reason(
    inprocess_plugins: Register, cuda_count_0: int
) -> None:
    inprocess_plugins(plugin_module("cardcage_foo", lambda: [UnavailableFoo]), "foo")
    selection = select(env={"FOO_CLUSTER": "1"})
    assert selection.accelerator == "cpu"
    (foo_entry,) = [e for e in selection.trace if e.rule == "foo_cluster"]
    assert (foo_entry.outcome, foo_entry.detail) == ("unavailable", "no Foo card in this machine")
    (line,) = [ln for ln in selection.explain().splitlines() if "foo_cluster" in ln]
    assert "unavailable" in line and "no Foo card in this machine" in line
    with pytest.raises(
        MisconfigurationError, match=r"no Foo card in this machine; plug in a Foo card\."
    ):
        select(env={}, distributed_backend="foo")


def test_a_rule_that_raises_is_recorded_and_selection_continues(
    inprocess_plugins: Register, cuda_count_0: int
) -> None:
    inprocess_plugins(plugin_module("cardcage_broken", lambda: [BrokenRuleAccelerator]), "broken")
    selection = select(env={}, num_processes=2)
    assert selection.accelerator == "ddp_spawn"
    (buggy,) = [e for e in selection.trace if e.rule == "buggy_rule"]
    assert buggy.outcome == "failed"
    assert "RuntimeError: the rule tripped over its own feet" in buggy.detail
    assert any("buggy_rule" in w and "broken" in w for w in selection.warnings)


def test_a_plugin_whose_hook_raises_is_recorded_and_skipped(
    inprocess_plugins: Register, cuda_count_0: int
) -> None:
    def explode() -> list[Any]:
        raise ImportError("needs libfoo.so")

    inprocess_plugins(plugin_module("cardcage_bad", explode), "bad")
    registry = plugins.registry({})
    (record,) = [r for r in registry.plugins if r.name == "bad"]
    assert record.status == "failed"
    assert "needs libfoo.so" in (record.error or "")
    assert "cpu" in registry.accelerators  # the others still load
    assert select(env={}).accelerator == "cpu"


def test_strict_plugins_turns_a_broken_plugin_into_an_error(
    inprocess_plugins: Register,
) -> None:
    def explode() -> list[Any]:
        raise ImportError("needs libfoo.so")

    inprocess_plugins(plugin_module("cardcage_bad", explode), "bad")
    with pytest.raises(PluginError, match=r"'bad'.*needs libfoo.so.*CARDCAGE_STRICT_PLUGINS"):
        plugins.registry({"CARDCAGE_STRICT_PLUGINS": "1"})


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (lambda: [object], "not a Accelerator subclass"),
        (lambda: ["foo"], "not a Accelerator subclass"),
        (lambda: [type("Nameless", (Accelerator,), {})], "Nameless without a name"),
        (
            lambda: [
                type(
                    "BadOrder",
                    (Accelerator,),
                    {"name": "bad_order", "rules": (Rule("100", lambda c: True, "x"),)},  # type: ignore[arg-type]
                )
            ],
            "not a Rule(order=int)",
        ),
    ],
)
def test_a_plugin_returning_garbage_is_recorded_and_skipped(
    inprocess_plugins: Register, returned: Callable[[], list[Any]], message: str
) -> None:
    inprocess_plugins(plugin_module("cardcage_garbage", returned), "garbage")
    (record,) = [r for r in plugins.registry({}).plugins if r.name == "garbage"]
    assert record.status == "failed"
    assert message in (record.error or "")


def test_two_plugins_claiming_one_name_is_an_error_naming_both(
    inprocess_plugins: Register,
) -> None:
    class OtherFoo(Accelerator):
        name = "foo"

    inprocess_plugins(plugin_module("cardcage_foo", lambda: [FooAccelerator]), "foo_one")
    inprocess_plugins(plugin_module("cardcage_foo2", lambda: [OtherFoo]), "foo_two")
    with pytest.raises(PluginError) as error:
        plugins.registry({})
    assert "'foo'" in str(error.value)
    assert "foo_one" in str(error.value) and "foo_two" in str(error.value)


def test_an_alias_taken_by_an_installed_backend_is_an_error_naming_both(
    inprocess_plugins: Register,
) -> None:
    class MySpawn(Accelerator):
        name = "my_spawn"
        aliases = ("spawn",)

    inprocess_plugins(plugin_module("cardcage_my_spawn", lambda: [MySpawn]), "my_spawn")
    with pytest.raises(PluginError) as error:
        plugins.registry({})
    message = str(error.value)
    assert "'spawn'" in message
    assert "cardcage-spawn" in message and "my_spawn" in message


def test_an_in_process_plugin_reusing_an_installed_plugins_name_is_an_error(
    inprocess_plugins: Register,
) -> None:
    inprocess_plugins(plugin_module("cardcage_cpu_again", lambda: []), "cpu")
    with pytest.raises(PluginError, match=r"'cpu' cannot be registered.*CARDCAGE_DISABLE_PLUGINS"):
        plugins.registry({})


# --- a cluster environment from a plugin ------------------------------------------------------


class FooScheduler(ClusterEnvironment):
    name = "fooscheduler"
    order = 250  # after torchelastic, before SLURM
    creates_processes = True

    @classmethod
    def detect(cls, env: Any, expected_world_size: int) -> bool:
        return "FOO_JOB" in env

    def world_size(self) -> int:
        return int(self.env["FOO_SIZE"])

    def global_rank(self) -> int:
        return int(self.env["FOO_RANK"])


def test_a_plugin_cluster_environment_supplies_the_ranks(
    inprocess_plugins: Register, cuda_count_0: int
) -> None:
    inprocess_plugins(plugin_module("cardcage_fooenv", environments=lambda: [FooScheduler]), "fenv")
    env = {"FOO_JOB": "7", "FOO_SIZE": "4", "FOO_RANK": "2", "SLURM_NTASKS": "1"}
    env["MASTER_PORT"] = "29500"  # (a cluster that started the processes must give one)
    selection = select(env=env)
    assert (selection.cluster, selection.world_size, selection.global_rank) == (
        "fooscheduler",
        4,
        2,
    )
    assert selection.accelerator == "ddp"  # a cluster created the processes (rule 300)


# --- the loading switches, through PluginManager with a fake environment ---------------------


def _status(records: list[plugins.PluginRecord]) -> dict[str, str]:
    return {r.name: r.status for r in records}


def test_autoload_off_loads_only_the_named_plugins() -> None:
    registry = PluginManager({"CARDCAGE_PLUGINS_AUTOLOAD": "0", "CARDCAGE_PLUGINS": "cpu"}).load()
    assert sorted(registry.accelerators) == ["cpu"]
    status = _status(registry.plugins)
    assert status["cpu"] == "loaded"
    assert status["ddp"] == "not autoloaded"


def test_disabled_plugins_are_not_loaded() -> None:
    registry = PluginManager({"CARDCAGE_DISABLE_PLUGINS": "ddp, spawn"}).load()
    assert "ddp" not in registry.accelerators and "ddp_spawn" not in registry.accelerators
    assert registry.canonical("ddp_cpu") is None
    assert _status(registry.plugins)["spawn"] == "disabled"
    assert "cpu" in registry.accelerators


def test_naming_a_plugin_that_is_not_installed_is_recorded() -> None:
    with pytest.warns(UserWarning, match="CARDCAGE_PLUGINS names 'nope'"):
        registry = PluginManager(
            {"CARDCAGE_PLUGINS_AUTOLOAD": "0", "CARDCAGE_PLUGINS": "nope"}
        ).load()
    (record,) = [r for r in registry.plugins if r.name == "nope"]
    assert record.status == "failed"
    assert "no installed distribution" in (record.error or "")


@functools.cache
def _plugin_install() -> Any:
    """tests/plugin_install.py, the helpers that pip-install throwaway plugin distributions
    (tests/conftest.py makes it importable for tests/ alone, so it is loaded by its path)."""
    path = Path(__file__).resolve().parents[3] / "tests" / "plugin_install.py"
    spec = importlib.util.spec_from_file_location("plugin_install", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """``install(entry_point, module_source, distribution=..., module=...)``: pip-installs a
    plugin distribution into a folder put first on ``sys.path``, so it is installed for this
    test only; its module leaves ``sys.modules`` afterwards."""
    site = tmp_path / "site"
    monkeypatch.syspath_prepend(str(site))

    def install(entry_point: str, module_source: str, **names: str) -> None:
        helpers = _plugin_install()
        source = helpers.plugin_source(tmp_path / "src", entry_point, module_source, **names)
        helpers.pip_install(site, [source], f"the {entry_point!r} plugin")
        importlib.invalidate_caches()
        module = names.get("module", f"cardcage_{entry_point}")
        monkeypatch.delitem(sys.modules, module, raising=False)

    return install


@pytest.mark.slow
def test_an_entry_point_that_fails_to_import_is_recorded_and_skipped(
    install: Callable[..., None],
) -> None:
    install("ghost", "import cardcage_no_such_module  # noqa: F401\n")
    registry = PluginManager({}).load()
    (record,) = [r for r in registry.plugins if r.name == "ghost"]
    assert record.status == "failed"
    # Its own module was found; the import inside it failed.
    assert "ModuleNotFoundError: No module named 'cardcage_no_such_module'" in (record.error or "")
    assert "cpu" in registry.accelerators
    with pytest.raises(PluginError, match="'ghost'"):
        PluginManager({"CARDCAGE_STRICT_PLUGINS": "1"}).load()
    # disabling it is the way out
    disabled = PluginManager({"CARDCAGE_DISABLE_PLUGINS": "ghost"}).load()
    assert _status(disabled.plugins)["ghost"] == "disabled"


@pytest.mark.slow
def test_two_entry_points_of_one_name_are_an_error(install: Callable[..., None]) -> None:
    # A distribution of its own name and module: both it and cardcage-cpu register 'cpu'.
    install("cpu", "", distribution="cardcage-cpu-fork", module="cardcage_cpu_fork")
    with pytest.raises(
        PluginError,
        match=r"two distributions register the cardcage plugin 'cpu': cardcage-cpu-fork and "
        r"cardcage-cpu\.",
    ):
        PluginManager({}).load()


def test_the_registry_is_cached_per_plugin_setting() -> None:
    assert plugins.registry({}) is plugins.registry({"UNRELATED": "1"})
    assert plugins.registry({}) is not plugins.registry({"CARDCAGE_DISABLE_PLUGINS": "tpu"})


@pytest.mark.parametrize("enabled", [True, False])
def test_loading_leaves_the_garbage_collector_as_it_was(enabled: bool) -> None:
    # Loading pauses automatic collection (a full one would walk torch's heap); a program
    # that turned it off itself must not find it switched back on, nor the reverse.
    import gc

    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        registry = PluginManager({}).load()
        assert "cpu" in registry.accelerators
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
