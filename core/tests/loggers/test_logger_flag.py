"""The ``logger`` flag: what each value resolves to, what is refused (naming the flag, the
value and the fix), and loggers that plugins register through ``cardcage_loggers``."""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import cardcage
from cardcage import sdk
from cardcage.loggers import (
    CSVLogger,
    LoggerCollection,
    TensorBoardLogger,
    check,
    resolve,
)
from cardcage.plugins import manager

Register = Callable[[object, str], None]


class MemoryLogger(sdk.Logger):
    """A plugin's logger, written as a plugin author would: only ``cardcage.sdk``."""

    logger_name = "Memory"

    def __init__(self, save_dir: str | None = None, name: str = "memory"):
        self._save_dir = save_dir
        self._name = name
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> int:
        return 0

    @property
    def save_dir(self) -> str | None:
        return self._save_dir

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, metrics))


def logger_plugin(*classes: object) -> types.ModuleType:
    module = types.ModuleType("cardcage_memory_logger")

    @cardcage.hookimpl
    def cardcage_loggers() -> list[object]:
        return list(classes)

    module.cardcage_loggers = cardcage_loggers  # type: ignore[attr-defined]
    return module


def test_true_is_a_csv_logger_under_default_root_dir_and_nothing_without_one(
    tmp_path: Path,
) -> None:
    registry = manager.registry({})
    logger = resolve(True, str(tmp_path), registry)
    assert isinstance(logger, CSVLogger)
    assert logger.log_dir == str(tmp_path / "logs" / "version_0")
    assert resolve(True, None, registry) is None
    assert resolve(False, str(tmp_path), registry) is None
    assert resolve(None, str(tmp_path), registry) is None
    assert list(tmp_path.iterdir()) == []  # resolving writes nothing


def test_a_logger_is_itself_and_a_list_is_a_collection(tmp_path: Path) -> None:
    registry = manager.registry({})
    mine = CSVLogger(tmp_path / "mine")
    assert resolve(mine, None, registry) is mine
    assert resolve([mine], None, registry) is mine
    assert resolve([], None, registry) is None
    both = resolve([mine, "csv"], str(tmp_path), registry)
    assert isinstance(both, LoggerCollection)
    assert both[0] is mine and isinstance(both[1], CSVLogger)
    assert both[1].save_dir == str(tmp_path)


def test_the_built_in_loggers_resolve_by_name(tmp_path: Path) -> None:
    registry = manager.registry({})
    assert {"csv": CSVLogger, "tensorboard": TensorBoardLogger}.items() <= (
        registry.loggers.items()
    )
    csv = resolve(" CSV ", str(tmp_path), registry)
    assert isinstance(csv, CSVLogger) and csv.save_dir == str(tmp_path)
    pytest.importorskip("tensorboard")
    assert isinstance(resolve("tensorboard", str(tmp_path), registry), TensorBoardLogger)


def test_a_plugin_logger_resolves_by_its_name(tmp_path: Path, inprocess_plugins: Register) -> None:
    """What ``Trainer(logger="memory")`` resolves: the plugin's class, built with
    ``save_dir=default_root_dir``; the plugin's record lists it."""
    inprocess_plugins(logger_plugin(MemoryLogger), "memory_logger")
    registry = manager.registry({})
    assert registry.loggers["memory"] is MemoryLogger
    assert "memory_logger (registered in-process)" in registry.logger_owners["memory"]
    (record,) = [r for r in registry.plugins if r.name == "memory_logger"]
    assert record.status == "loaded" and record.loggers == ("memory",)
    logger = resolve("memory", str(tmp_path), registry)
    assert isinstance(logger, MemoryLogger) and logger.save_dir == str(tmp_path)
    check("MEMORY", str(tmp_path), registry)


def test_a_plugin_logger_taking_a_built_in_name_is_an_error_naming_both(
    inprocess_plugins: Register,
) -> None:
    class MyCSV(MemoryLogger):
        logger_name = "csv"

    inprocess_plugins(logger_plugin(MyCSV), "my_csv")
    with pytest.raises(cardcage.PluginError) as error:
        manager.registry({})
    message = str(error.value)
    assert "'csv'" in message and "cardcage-core (built in)" in message and "my_csv" in message


def test_two_plugins_claiming_one_logger_name_is_an_error_naming_both(
    inprocess_plugins: Register,
) -> None:
    class Other(MemoryLogger):
        logger_name = "memory"

    inprocess_plugins(logger_plugin(MemoryLogger), "first")
    inprocess_plugins(logger_plugin(Other), "second")
    with pytest.raises(cardcage.PluginError, match=r"'memory' is claimed twice: first .* second"):
        manager.registry({})


class Abstract(sdk.Logger):
    logger_name = "abstract"


class NeedsMore(MemoryLogger):
    logger_name = "needs_more"

    def __init__(self, save_dir: str, project: str):
        super().__init__(save_dir)


class Nameless(MemoryLogger):
    logger_name = ""


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (object, "not a cardcage.sdk.Logger subclass"),
        ("csv", "not a cardcage.sdk.Logger subclass"),
        (MemoryLogger(), "not a cardcage.sdk.Logger subclass"),
        (Nameless, "Nameless without a logger_name"),
        (Abstract, "Abstract, which does not implement log_hyperparams, log_metrics, name"),
        (NeedsMore, "NeedsMore(save_dir=...) (missing a required argument: 'project')"),
    ],
)
def test_a_plugin_returning_a_bad_logger_fails_to_load_and_is_listed(
    inprocess_plugins: Register, returned: object, message: str
) -> None:
    inprocess_plugins(logger_plugin(returned), "bad_logger")
    registry = manager.registry({})
    (record,) = [r for r in registry.plugins if r.name == "bad_logger"]
    assert record.status == "failed"
    assert message in (record.error or "")
    with pytest.raises(cardcage.PluginError, match="bad_logger"):
        manager.registry({"CARDCAGE_STRICT_PLUGINS": "1"})


REFUSED: list[tuple[object, str]] = [
    (42, r"^logger=42 \(int\) is not a logger\. Pass True .*, False, a cardcage\.loggers\.Logger"),
    ("tensorbord", r"^logger='tensorbord': no .*Did you mean 'tensorboard'\? Known logger names: "),
    ("nothing_like_it", r"names: 'csv', 'tensorboard' \(a plugin adds more .*cardcage_loggers"),
    ("", r"^logger='' names no logger\. Pass True"),
    (CSVLogger, r"^logger=CSVLogger is a logger class, not a logger: construct it, logger=CSV"),
    ([True], r"^logger=\[\.\.\.\]: item 0, True \(bool\) is not a logger\. Pass True"),
    ({"csv": 1}, r"^logger=\{'csv': 1\} \(dict\) is not a logger"),
]


@pytest.mark.parametrize(("value", "message"), REFUSED, ids=[repr(v) for v, _ in REFUSED])
def test_a_bad_logger_flag_is_refused_naming_flag_value_and_fix(
    tmp_path: Path, value: object, message: str
) -> None:
    registry = manager.registry({})
    with pytest.raises(cardcage.MisconfigurationError, match=message):
        resolve(value, str(tmp_path), registry)
    with pytest.raises(cardcage.MisconfigurationError, match=message):
        check(value, str(tmp_path), registry)


def test_a_name_without_default_root_dir_is_refused_with_both_fixes() -> None:
    registry = manager.registry({})
    message = (
        r"^logger='csv' builds CSVLogger\(save_dir=default_root_dir\), and default_root_dir is "
        r"not set\. Set default_root_dir='<folder>', or pass the logger itself: "
        r"logger=CSVLogger\(save_dir='<folder>'\)\.$"
    )
    with pytest.raises(cardcage.MisconfigurationError, match=message):
        resolve("csv", None, registry)
    with pytest.raises(cardcage.MisconfigurationError, match=message):
        check(["csv"], None, registry)


def test_a_named_logger_whose_package_is_missing_is_refused_before_it_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(__import__("sys").modules, "tensorboard", None)
    registry = manager.registry({})
    with pytest.raises(cardcage.MisconfigurationError, match=r"cardcage\[tensorboard\]"):
        check("tensorboard", str(tmp_path), registry)


def test_check_without_a_registry_checks_the_form_only(tmp_path: Path) -> None:
    """What ``select`` can call before any registry is loaded: names are not looked up."""
    check("anything", str(tmp_path))
    check([CSVLogger(tmp_path), "x"], str(tmp_path))
    for fine in (True, False, None):
        check(fine, None)
    with pytest.raises(cardcage.MisconfigurationError, match=r"logger=3\.5 \(float\)"):
        check(3.5, None)
    with pytest.raises(cardcage.MisconfigurationError, match=r"default_root_dir is not set"):
        check("anything", None)
    assert list(tmp_path.iterdir()) == []


def test_a_fit_writes_to_the_plugin_logger_its_name_selects(
    tmp_path: Path, inprocess_plugins: Register
) -> None:
    """``Trainer(logger="memory")`` end to end: the registered class is built and the fit's
    step and epoch values reach it; ``select`` refuses a misspelt name as the Trainer does."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    inprocess_plugins(logger_plugin(MemoryLogger), "memory_logger")

    class Logs(cardcage.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self.layer(batch[0]).pow(2).mean()
            self.log("train_loss", loss, on_epoch=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = cardcage.Trainer(
        logger="memory", default_root_dir=str(tmp_path), log_every_n_steps=2, progress_bar=False
    )
    assert isinstance(trainer.logger, MemoryLogger)
    trainer.fit(Logs(), DataLoader(TensorDataset(torch.ones(8, 1)), batch_size=2))
    steps = [step for step, _ in trainer.logger.rows]
    assert steps == [1, 3, 3], trainer.logger.rows  # every 2nd step, then the epoch's mean
    assert "train_loss_epoch" in trainer.logger.rows[-1][1]
    with pytest.raises(cardcage.MisconfigurationError, match="memroy"):
        cardcage.select(logger="memroy", default_root_dir=str(tmp_path))
