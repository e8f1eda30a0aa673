"""The TensorBoard logger: scalars and hyperparameters TensorBoard reads back, nothing on
disk before the first write, a pickle without its writer, and a clear refusal without the
tensorboard package."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest

import cardcage
from cardcage.loggers import TensorBoardLogger


def read_events(folder: str) -> object:
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    ).EventAccumulator(folder)
    accumulator.Reload()
    return accumulator


@pytest.fixture
def tensorboard_installed() -> None:
    pytest.importorskip("tensorboard")


@pytest.mark.usefixtures("tensorboard_installed")
def test_the_logged_scalars_read_back_from_the_events_file(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path)
    logger.log_metrics({"loss": 0.5, "acc": 0.25}, step=0)
    logger.log_metrics({"loss": 0.125}, step=3)
    logger.finalize("success")
    assert logger.log_dir == str(tmp_path / "logs" / "version_0")
    events = read_events(logger.log_dir)
    scalars = events.Tags()["scalars"]  # type: ignore[attr-defined]
    assert sorted(scalars) == ["acc", "loss"]
    loss = [(e.step, e.value) for e in events.Scalars("loss")]  # type: ignore[attr-defined]
    assert loss == [(0, 0.5), (3, 0.125)]
    assert [(e.step, e.value) for e in events.Scalars("acc")] == [(0, 0.25)]  # type: ignore[attr-defined]


@pytest.mark.usefixtures("tensorboard_installed")
def test_hyperparameters_reach_the_hparams_dashboard_and_hparams_yaml(tmp_path: Path) -> None:
    from tensorboard.plugins.hparams import plugin_data_pb2  # type: ignore[import-untyped]

    logger = TensorBoardLogger(tmp_path)
    logger.log_hyperparams({"lr": 0.01, "optimizer": "adam", "schedule": {"gamma": 0.5}})
    logger.finalize("success")
    content = read_events(logger.log_dir).PluginTagToContent("hparams")  # type: ignore[attr-defined]
    data = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"])
    names = sorted(info.name for info in data.experiment.hparam_infos)
    assert names == ["lr", "optimizer", "schedule/gamma"]
    start = plugin_data_pb2.HParamsPluginData.FromString(
        content["_hparams_/session_start_info"]
    ).session_start_info
    assert start.hparams["lr"].number_value == 0.01
    assert start.hparams["optimizer"].string_value == "adam"
    assert (Path(logger.log_dir) / "hparams.yaml").read_text() == (
        "lr: 0.01\noptimizer: adam\nschedule:\n  gamma: 0.5\n"
    )


@pytest.mark.usefixtures("tensorboard_installed")
def test_nothing_is_on_disk_and_no_writer_exists_before_the_first_write(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="tb")
    assert logger.version == 0
    logger.save()
    logger.finalize("success")
    assert list(tmp_path.iterdir()) == []
    copy = pickle.loads(pickle.dumps(logger))
    copy.log_metrics({"x": 1.0}, step=0)
    copy.finalize("success")
    (events,) = (tmp_path / "tb" / "version_0").iterdir()
    assert events.name.startswith("events.out.tfevents")


@pytest.mark.usefixtures("tensorboard_installed")
def test_a_logger_that_has_written_pickles_without_its_writer(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path)
    logger.log_metrics({"x": 1.0}, step=0)
    copy = pickle.loads(pickle.dumps(logger))  # would fail on the writer's lock and file
    assert copy._writer is None and logger._writer is not None
    copy.log_metrics({"x": 2.0}, step=1)
    copy.finalize("success")
    logger.finalize("success")
    values = [(e.step, e.value) for e in read_events(logger.log_dir).Scalars("x")]  # type: ignore[attr-defined]
    assert sorted(values) == [(0, 1.0), (1, 2.0)]


def test_without_tensorboard_it_is_refused_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed
    with pytest.raises(
        cardcage.MisconfigurationError,
        match=r"TensorBoardLogger needs the tensorboard package.*pip install "
        r"'cardcage\[tensorboard\]'",
    ):
        TensorBoardLogger(tmp_path)
    assert list(tmp_path.iterdir()) == []
