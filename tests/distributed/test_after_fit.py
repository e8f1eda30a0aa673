"""The Trainer after a 2-process fit, with real processes on gloo (``scripts/after_fit_job.py``):
only rank 0's loggers write (rank 1's ``trainer.logger`` is a ``DummyLogger``, and what it is
given to write reaches no file), and ``trainer.test`` on the same Trainer returns what its
``test_step`` logged, equal to a plain PyTorch evaluation of the trained weights, while the
fit's ``metrics.csv`` rows stay and a test row is added. Under ``ddp_spawn`` (workers trained,
the caller tests alone) and ``ddp`` (this script relaunched as rank 1; both ranks test).
One process: tests/test_after_fit.py.

As elsewhere in tests/distributed/, the jobs are listed in ``SCENARIOS`` and started together
by the ``scenarios`` fixture; each test waits for its own.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "after_fit_job.py"
#: What rank 1's callback writes through its ``trainer.logger``.
PROBE = "written_by_rank_1"


def job_module() -> Any:
    name = "cardcage_after_fit_job"
    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(harness: Any, backend: str) -> dict[str, Any]:
    """Run the job; what each rank's callback saw at the end of fit (``info-rank<R>.json``),
    and what each process that ran the script left (``result-rank<R>.json``)."""
    out = harness.root / "out"
    out.mkdir(parents=True)
    harness.start([sys.executable, str(SCRIPT), str(out), backend], name=backend).check()
    harness.assert_no_leftovers()
    return {"fit": harness.infos(out), "result": harness.results(out)}


BACKENDS = ("ddp_spawn", "ddp")
SCENARIOS: dict[str, Callable[[Any], Any]] = {
    backend: (lambda h, b=backend: run(h, b)) for backend in BACKENDS
}


def plain_test_loss(weights: dict[str, list[Any]]) -> float:
    """The mean squared error of the trained weights over the test data, in plain PyTorch."""
    module = job_module()
    net = torch.nn.Linear(module.FEATURES, 1)
    net.load_state_dict({k: torch.tensor(v) for k, v in weights.items()})
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in DataLoader(module.test_data(), batch_size=5):  # other batches: same mean
            total += float(torch.nn.functional.mse_loss(net(x), y, reduction="sum"))
            count += len(x)
    return total / count


@pytest.mark.parametrize("scenario", BACKENDS)
def test_only_rank_0_writes_the_runs_files(scenarios: Any, scenario: str) -> None:
    """One run folder per logger, one metrics.csv, one hparams.yaml each, one events file
    (rank 0's): rank 1 wrote none, though its callback wrote through ``trainer.logger``."""
    job = scenarios.result(scenario)
    fit, rank0 = job["fit"], job["result"][0]
    assert sorted(fit) == [0, 1]
    rank0_pid = fit[0]["pid"]
    files = rank0["fit_files"]
    tensorboard = rank0["tensorboard"]
    wanted = ["logs/version_0/hparams.yaml", "logs/version_0/metrics.csv"]
    if tensorboard:
        wanted += [f"tb/version_0/events.out.tfevents.{rank0_pid}", "tb/version_0/hparams.yaml"]
    # the events file's name is events.out.tfevents.<time>.<host>.<pid>.<n>
    found = [
        f"tb/version_0/events.out.tfevents.{f.split('.')[-2]}" if ".tfevents." in f else f
        for f in files
    ]
    assert sorted(found) == sorted(wanted), files
    assert not any(r.get(PROBE) for r in rank0["fit_rows"]), rank0["fit_rows"]
    assert all(PROBE not in r for r in rank0["fit_rows"] + rank0["test_rows"])
    # rank 1 wrote nothing after fit either (under ddp, it tested too)
    rank1_pid = str(fit[1]["pid"])
    assert not [f for f in rank0["test_files"] if f.split(".")[-2:-1] == [rank1_pid]]
    assert "version_1" not in " ".join(rank0["test_files"])
    assert rank0["hparams"] and all(PROBE not in text for text in rank0["hparams"])
    assert fit[0]["class"] == "LoggerCollection"
    assert fit[1]["class"] == "DummyLogger", fit[1]


@pytest.mark.parametrize("scenario", BACKENDS)
def test_every_ranks_logger_names_rank_0s_folders(scenarios: Any, scenario: str) -> None:
    """A callback reading ``trainer.logger.log_dir`` finds rank 0's folder on every rank
    (under ddp, a relaunched rank 1 picked the next free version, version_1, until the ranks
    took rank 0's from it when each process sets up)."""
    fit = scenarios.result(scenario)["fit"]
    assert fit[1]["version"] == fit[0]["version"] == "0_0"
    assert fit[1]["log_dirs"] == fit[0]["log_dirs"]


@pytest.mark.parametrize("scenario", BACKENDS)
def test_test_after_fit_returns_the_logged_loss_and_appends_to_the_fits_csv(
    scenarios: Any, scenario: str
) -> None:
    """``test()`` returns ``[{"test_loss": v}]``, v the plain loop's loss of the trained
    weights (on every process that tested); ``metrics.csv`` keeps every row fit wrote, and a
    test row follows them (before the fix, a ``ddp_spawn`` fit's file was replaced)."""
    results = scenarios.result(scenario)["result"]
    assert sorted(results) == ([0] if scenario == "ddp_spawn" else [0, 1])
    for rank, result in results.items():
        wanted = plain_test_loss(result["weights"])
        assert len(result["test"]) == 1 and list(result["test"][0]) == ["test_loss"], rank
        assert result["test"][0]["test_loss"] == pytest.approx(wanted, abs=1e-6), rank
    rank0 = results[0]
    before, after = rank0["fit_rows"], rank0["test_rows"]
    assert len(before) == 4 and all(r["train_loss"] for r in before)  # 4 steps of rank 0
    assert before[-1]["val_loss"]
    # the header widens with test_loss: the fit's rows, with that column empty, come first
    assert [{k: v for k, v in r.items() if k in before[0]} for r in after[: len(before)]] == before
    assert all(not r["test_loss"] for r in after[: len(before)])
    (test_row,) = after[len(before) :]
    assert float(test_row["test_loss"]) == pytest.approx(rank0["test"][0]["test_loss"])
    assert not test_row["train_loss"] and not test_row["val_loss"]
