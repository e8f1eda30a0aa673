"""The Trainer after ``fit``, in one process: ``test``/``validate``/``predict`` run the model
passed in (its hooks, its ``self.log``) and return Lightning 1.0's list of dicts; the fit's
CSV rows stay as they were; a second ``fit`` is a new run; ``logger=True`` without
``default_root_dir`` writes under the current folder; ``step``/``epoch`` cannot be logged;
a failed fit finalizes its logger. (Two processes: tests/distributed/test_after_fit.py.)"""

from __future__ import annotations

import csv
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage
from cardcage import MisconfigurationError
from cardcage.loggers import CSVLogger, Logger


def loader(seed: int = 0, samples: int = 8) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 2, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


class Logged(cardcage.Module):
    """Logs in every step; records which of its hooks ran under its own ``tag``."""

    def __init__(self, tag: str, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Linear(2, 1)
        self.tag = tag
        self.events: list[str] = []

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_mse", self.loss(batch))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_mse", self.loss(batch))
        self.log(f"test_by_{self.tag}", 1.0)

    def predict_step(self, batch: Any, batch_idx: int) -> str:
        return self.tag

    def on_test_epoch_start(self) -> None:
        self.events.append("on_test_epoch_start")

    def on_validation_epoch_start(self) -> None:
        self.events.append("on_validation_epoch_start")

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def expected_mse(model: Logged, data: DataLoader[Any]) -> float:
    with torch.no_grad():
        return sum(float(model.loss(b)) * len(b[0]) for b in data) / len(data.dataset)  # type: ignore[arg-type]


def test_test_after_fit_runs_the_model_passed_in_and_returns_what_it_logged(
    tmp_path: Path,
) -> None:
    """Before: every self.log in test_step was dropped ("called outside trainer.fit"), test()
    returned {} and the fitted model's hooks ran."""
    fitted, other = Logged("fitted"), Logged("other", seed=1)
    trainer = cardcage.Trainer(max_epochs=1, progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(fitted, loader(), loader(1))
    fitted.events.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "outside trainer.fit" warning, no deprecation
        results = trainer.test(other, loader(2))
        assert results == [
            {"test_mse": pytest.approx(expected_mse(other, loader(2))), "test_by_other": 1.0}
        ]
        assert trainer.validate(dataloaders=loader(2)) == [
            {"val_mse": pytest.approx(expected_mse(other, loader(2)))}
        ]
        assert trainer.predict(dataloaders=loader(2)) == ["other", "other"]
    assert other.events == ["on_test_epoch_start", "on_validation_epoch_start"]
    assert fitted.events == []
    assert other.trainer is None  # bound while it ran, not after
    assert float(trainer.callback_metrics["test_mse"]) == pytest.approx(results[0]["test_mse"])


def test_several_loaders_give_one_dict_each_and_the_old_dict_is_deprecated() -> None:
    model = Logged("m")
    trainer = cardcage.Trainer(max_epochs=1, progress_bar=False)
    trainer.fit(model, loader())
    results = trainer.test(model, [loader(2), loader(3)])
    assert results == [
        {
            "test_mse/dataloader_idx_0": pytest.approx(expected_mse(model, loader(2))),
            "test_by_m/dataloader_idx_0": 1.0,
        },
        {
            "test_mse/dataloader_idx_1": pytest.approx(expected_mse(model, loader(3))),
            "test_by_m/dataloader_idx_1": 1.0,
        },
    ]
    both = (expected_mse(model, loader(2)) + expected_mse(model, loader(3))) / 2
    with pytest.warns(DeprecationWarning, match=r"results\[0\]\['test_mse'\]"):
        assert results["test_mse"] == pytest.approx(both)  # type: ignore[call-overload]
    assert trainer.logged_metrics["test_mse"] == pytest.approx(both)


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        return list(csv.DictReader(file))


def test_a_test_row_does_not_merge_into_the_last_validation_row(tmp_path: Path) -> None:
    """Before: the test row merged into the last validation row and overwrote its epoch."""
    model = Logged("m")
    trainer = cardcage.Trainer(max_epochs=1, progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(model, loader(), loader(1))
    val = rows(tmp_path / "logs" / "version_0" / "metrics.csv")
    trainer.test(model, loader(2))
    trainer.test(model, loader(3))
    after = rows(tmp_path / "logs" / "version_0" / "metrics.csv")
    assert [{k: v for k, v in r.items() if v} for r in after[: len(val)]] == val
    assert val[-1]["epoch"] == "0.0"
    tests = after[len(val) :]
    assert [r["epoch"] for r in tests] == ["1.0", "1.0"]  # two tests: two rows
    assert tests[0]["test_mse"] != tests[1]["test_mse"] and not tests[0]["val_mse"]


def test_a_second_fit_is_a_new_run(tmp_path: Path) -> None:
    """Its own counters from 0 and its own version folder (before: the same version_0, the
    steps counted on)."""
    trainer = cardcage.Trainer(max_epochs=1, progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(Logged("a"), loader(), loader(1))
    first_version = trainer.logger.version
    second = Logged("b", seed=3)
    trainer.fit(second, loader(), loader(1))
    assert (first_version, trainer.logger.version) == (0, 1)
    assert trainer.global_step == 2 and trainer.current_epoch == 1
    assert trainer.restarts == 0 and trainer.restart_from is None
    assert [r["step"] for r in rows(tmp_path / "logs" / "version_1" / "metrics.csv")] == ["1"]


def test_logger_true_passed_explicitly_writes_under_the_current_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning writes ./lightning_logs for logger=True; before, nothing was written. Left
    out, no file (tests/test_trainer.py::test_fit_writes_no_file_without_default_root_dir)."""
    monkeypatch.chdir(tmp_path)
    trainer = cardcage.Trainer(max_epochs=1, progress_bar=False, logger=True)
    assert isinstance(trainer.logger, CSVLogger)
    trainer.fit(Logged("m"), loader(), loader(1))
    assert rows(tmp_path / "logs" / "version_0" / "metrics.csv")[0]["val_mse"]
    assert cardcage.Trainer(progress_bar=False).logger is None


@pytest.mark.parametrize("name", ["step", "epoch"])
def test_logging_step_or_epoch_is_refused_by_name(name: str, tmp_path: Path) -> None:
    """Before: self.log("step", v) rewrote the CSV's step column."""

    class LogsReserved(Logged):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.log(name, 100.0)
            return self.loss(batch)

    trainer = cardcage.Trainer(max_epochs=1, progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(MisconfigurationError, match=rf"self\.log\('{name}', \.\.\.\)"):
        trainer.fit(LogsReserved("m"), loader())


class Recording(Logger):
    def __init__(self) -> None:
        self.finalized: list[str] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def finalize(self, status: str) -> None:
        self.finalized.append(status)


def test_a_failed_fit_finalizes_its_logger_as_failed() -> None:
    class Fails(Logged):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            raise RuntimeError("boom")

    logger = Recording()
    trainer = cardcage.Trainer(max_epochs=1, progress_bar=False, logger=logger)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Fails("m"), loader())
    assert logger.finalized == ["failed"]
    trainer.fit(Logged("m"), loader())
    assert logger.finalized == ["failed", "success"]
