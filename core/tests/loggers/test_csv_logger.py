"""The CSV logger: the exact file it writes, the rows it keeps, its versions, and that it
writes nothing before its first write and pickles to a training process."""

from __future__ import annotations

import argparse
import csv
import math
import multiprocessing
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from cardcage.loggers import CSVLogger, Logger, LoggerCollection
from cardcage.loggers.hparams import to_yaml


def files_under(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


def test_a_new_metric_rewrites_the_header_and_a_step_logged_again_merges_its_row(
    tmp_path: Path,
) -> None:
    """The file after every call: one row per step, ``step`` first, columns in first-seen
    order, values as written, empty cells where a metric was not logged."""
    logger = CSVLogger(tmp_path)
    path = tmp_path / "logs" / "version_0" / "metrics.csv"

    logger.log_metrics({"loss": 0.5}, step=0)
    assert path.read_text() == "step,loss\n0,0.5\n"
    logger.log_metrics({"loss": 0.25}, step=1)
    assert path.read_text() == "step,loss\n0,0.5\n1,0.25\n"
    # a metric not seen before, mid-run: the whole file again, under the wider header
    logger.log_metrics({"loss": 0.125, "acc": 1}, step=2)
    assert path.read_text() == "step,loss,acc\n0,0.5,\n1,0.25,\n2,0.125,1\n"
    # validation at the step of the last row: merged into it, no second row for step 2
    logger.log_metrics({"val_loss": torch.tensor(0.75)}, step=2)
    assert path.read_text() == "step,loss,acc,val_loss\n0,0.5,,\n1,0.25,,\n2,0.125,1,0.75\n"
    logger.log_metrics({"val_loss": 0.5}, step=2)  # would overwrite: a row of its own
    assert path.read_text().endswith("2,0.125,1,0.75\n2,,,0.5\n")
    logger.log_metrics({"acc": 0}, step=2)  # merged into that row: the row rewritten
    logger.log_metrics({"loss": 0.1}, step=3)  # appended under the same header
    assert path.read_text() == (
        "step,loss,acc,val_loss\n0,0.5,,\n1,0.25,,\n2,0.125,1,0.75\n2,,0,0.5\n3,0.1,,\n"
    )
    assert logger.metrics == [
        {"step": 0, "loss": 0.5},
        {"step": 1, "loss": 0.25},
        {"step": 2, "loss": 0.125, "acc": 1, "val_loss": 0.75},
        {"step": 2, "val_loss": 0.5, "acc": 0},
        {"step": 3, "loss": 0.1},
    ]
    assert logger.experiment.metrics is logger.metrics
    with path.open(newline="") as file:
        rows = list(csv.DictReader(file))
    assert [row["loss"] for row in rows] == ["0.5", "0.25", "0.125", "", "0.1"]


def test_floats_are_written_as_python_prints_them(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path)
    values = {"a": 1 / 3, "b": 1e-8, "c": math.inf, "d": 7}
    logger.log_metrics(values, step=5)
    text = (Path(logger.log_dir) / "metrics.csv").read_text()
    assert text == f"step,a,b,c,d\n5,{1 / 3!r},1e-08,inf,7\n"
    row = next(csv.DictReader(text.splitlines()))
    assert float(row["a"]) == 1 / 3  # read back exactly


def test_nothing_is_on_disk_before_the_first_write(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path / "runs", name="exp")
    assert logger.version == 0  # reading the version reads the folder, creates nothing
    assert logger.log_dir == str(tmp_path / "runs" / "exp" / "version_0")
    assert logger.metrics == []
    logger.save()
    logger.finalize("success")
    assert files_under(tmp_path) == []
    logger.log_metrics({"x": 1.0}, step=0)
    assert files_under(tmp_path) == [
        "runs",
        "runs/exp",
        "runs/exp/version_0",
        "runs/exp/version_0/metrics.csv",
    ]


def test_each_run_takes_the_next_free_version(tmp_path: Path) -> None:
    first = CSVLogger(tmp_path)
    first.log_metrics({"x": 1.0}, step=0)
    second = CSVLogger(tmp_path)  # built after the first wrote: version_1
    second.log_metrics({"x": 2.0}, step=0)
    (tmp_path / "logs" / "version_7").mkdir()
    third = CSVLogger(tmp_path)
    assert (first.version, second.version, third.version) == (0, 1, 8)
    assert (tmp_path / "logs" / "version_1" / "metrics.csv").read_text() == "step,x\n0,2.0\n"
    # an explicit version: an int is version_<n>, a string the folder's name; no name level
    assert CSVLogger(tmp_path, version=3).log_dir == str(tmp_path / "logs" / "version_3")
    assert CSVLogger(tmp_path, name="", version="b").log_dir == str(tmp_path / "b")


def test_a_version_is_picked_at_the_first_write_not_at_construction(tmp_path: Path) -> None:
    """Two loggers built before either writes: each takes the version free when it first
    needs one (the second one built in the caller of a spawned run still gets its own)."""
    early = CSVLogger(tmp_path)
    late = CSVLogger(tmp_path)
    early.log_metrics({"x": 1.0}, step=0)
    late.log_metrics({"x": 1.0}, step=0)
    assert (early.version, late.version) == (0, 1)


def test_an_explicit_version_that_holds_metrics_warns(tmp_path: Path) -> None:
    CSVLogger(tmp_path, version=0).log_metrics({"x": 1.0}, step=0)
    again = CSVLogger(tmp_path, version=0)
    with pytest.warns(UserWarning, match=r"metrics.csv exists and is replaced"):
        again.log_metrics({"y": 2.0}, step=0)
    assert (tmp_path / "logs" / "version_0" / "metrics.csv").read_text() == "step,y\n0,2.0\n"


def test_hparams_yaml_holds_the_hyperparameters_logged(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path)
    logger.log_hyperparams({"lr": 0.001, "optimizer": "adam", "layers": [64, 32]})
    logger.log_hyperparams(argparse.Namespace(batch_size=8, schedule={"gamma": 0.5}))
    path = tmp_path / "logs" / "version_0" / "hparams.yaml"
    assert path.read_text() == (
        "lr: 0.001\n"
        "optimizer: adam\n"
        "layers:\n"
        "  - 64\n"
        "  - 32\n"
        "batch_size: 8\n"
        "schedule:\n"
        "  gamma: 0.5\n"
    )
    assert logger.hparams == {
        "lr": 0.001,
        "optimizer": "adam",
        "layers": [64, 32],
        "batch_size": 8,
        "schedule": {"gamma": 0.5},
    }
    assert not (path.parent / "metrics.csv").exists()  # no metrics logged, no metrics file


HPARAMS: dict[str, Any] = {
    "lr": 1e-05,
    "big": 1e20,
    "nan": math.nan,
    "inf": -math.inf,
    "flag": True,
    "none": None,
    "yes": "yes",  # YAML 1.1 would read a plain yes as True
    "number_string": "10",
    "colon": "a: b",
    "quote": 'say "hi"\n',
    "unicode": "é",
    "path": "runs/exp-1.ckpt",
    "empty_list": [],
    "empty_dict": {},
    "tuple": (1, "x"),
    "nested": {"list": [{"a": 1, "b": [2, 3]}, [4, 5]], "deeper": {"x": "y"}},
    "tensor": torch.tensor([1.5, 2.5]),
    "dtype": torch.float32,
}


def test_hparams_yaml_reads_back_as_the_values_given() -> None:
    yaml = pytest.importorskip("yaml")
    loaded = yaml.safe_load(to_yaml(HPARAMS))
    expected = {
        **HPARAMS,
        "tuple": [1, "x"],
        "tensor": [1.5, 2.5],
        "dtype": "torch.float32",
    }
    assert math.isnan(loaded.pop("nan"))
    expected.pop("nan")
    assert loaded == expected
    assert yaml.safe_load(to_yaml({})) == {}


def test_hparams_yaml_without_a_yaml_library_is_plain_text() -> None:
    """The exact text of the values a YAML reader would get wrong if written naively."""
    text = to_yaml({"lr": 1e-05, "yes": "yes", "n": "10", "s": "a: b", "ok": "adam"})
    assert text == 'lr: 1.0e-05\n"yes": "yes"\n"n": "10"\ns: "a: b"\nok: adam\n'


def test_a_logger_pickles_to_a_training_process_before_and_after_writing(
    tmp_path: Path,
) -> None:
    logger = CSVLogger(tmp_path)
    copy = pickle.loads(pickle.dumps(logger))
    copy.log_metrics({"x": 1.0}, step=0)  # the copy (rank 0 of a spawned run) writes
    assert (tmp_path / "logs" / "version_0" / "metrics.csv").is_file()
    copy.log_metrics({"x": 2.0}, step=1)
    again = pickle.loads(pickle.dumps(copy))  # rows, header and version travel with it
    again.log_metrics({"x": 3.0}, step=2)
    assert again.metrics == [{"step": s, "x": float(s + 1)} for s in range(3)]
    assert (tmp_path / "logs" / "version_0" / "metrics.csv").read_text() == (
        "step,x\n0,1.0\n1,2.0\n2,3.0\n"
    )


@pytest.mark.slow
def test_a_logger_built_here_writes_from_a_spawned_process(tmp_path: Path) -> None:
    """What a spawned run does: the caller builds the logger (writing nothing), a fresh
    interpreter unpickles it and writes; the caller's copy stays empty."""
    logger = CSVLogger(tmp_path)
    process = multiprocessing.get_context("spawn").Process(
        target=logger.log_metrics, args=({"loss": 0.5}, 7)
    )
    process.start()
    process.join(timeout=120)
    assert process.exitcode == 0
    assert (tmp_path / "logs" / "version_0" / "metrics.csv").read_text() == "step,loss\n7,0.5\n"
    assert logger.metrics == []


def test_a_collection_passes_every_call_to_each_logger(tmp_path: Path) -> None:
    a, b = CSVLogger(tmp_path, name="a"), CSVLogger(tmp_path, name="b")
    both = LoggerCollection([a, b])
    both.log_hyperparams({"lr": 0.1})
    both.log_metrics({"x": 1.0}, step=0)
    both.finalize("success")
    assert a.metrics == b.metrics == [{"step": 0, "x": 1.0}]
    assert (both.name, both.version, both.save_dir, both.log_dir) == ("a_b", "0_0", None, None)
    assert list(both) == [a, b] and both[1] is b and len(both) == 2
    assert os.path.isfile(os.path.join(b.log_dir, "hparams.yaml"))


def test_a_logger_must_implement_the_abstract_methods() -> None:
    class Partial(Logger):
        @property
        def name(self) -> str:
            return "p"

    with pytest.raises(TypeError, match="abstract"):
        Partial()  # type: ignore[abstract]
