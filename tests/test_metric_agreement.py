"""The ranks agree on the metrics they reduce together (cardcage.train.agreement), with two
real ddp_spawn processes on gloo.

Each metric reduction packs each rank's values position by position. Before the fix, rank
1's ``zzz`` was added into rank 0's ``val_loss`` (exit 0, a wrong number), and a name or a
batch one rank lacked left the other waiting for ``CARDCAGE_TIMEOUT``. Now every rank
refuses, naming each rank's names (or train loader lengths), within seconds.

As in tests/distributed/, the module's jobs are listed in ``SCENARIOS`` and started together
by the ``scenarios`` fixture (``-k`` is honoured); each test waits for its own.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from cardcage.testing.harness import Harness

pytestmark = pytest.mark.slow

#: A refusal must end the job this soon after the rank reached the mismatched hook.
REFUSED_WITHIN = 30.0
#: Start-up of two spawned processes on a loaded machine, and the refusal.
RUN_TIMEOUT = 120.0

SCRIPT = '''
import json, os, sys, time
import torch
import torch.distributed as dist
import cardcage

MODE = sys.argv[1]


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


class PerRank:
    """A loader of `lengths[rank]` batches of 2 samples, each of value rank."""

    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return self.lengths[rank()]

    def __iter__(self):
        for _ in range(len(self)):
            yield (torch.full((2, 1), float(rank())),)


class Model(cardcage.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def reached(self):
        print(f"REACHED {time.time()}", flush=True)

    def training_step(self, batch, batch_idx):
        r = rank()
        if MODE.startswith("step_names"):
            self.reached()
            self.log("train_a" if r == 0 else "zzz", 1.0 + r, sync_dist=True)
        if MODE == "order":
            first, second = ("ta", "tb") if r == 0 else ("tb", "ta")
            values = {"ta": 1.0 + 10 * r, "tb": 100.0 + r}
            self.log(first, values[first], on_step=False, on_epoch=True, sync_dist=True)
            self.log(second, values[second], on_step=False, on_epoch=True, sync_dist=True)
        return (self.w - 1).pow(2).sum()

    def validation_step(self, batch, batch_idx):
        r = rank()
        if MODE == "val_names":
            self.reached()
            self.log("val_loss" if r == 0 else "zzz", 2.4 if r == 0 else 100.0, sync_dist=True)
        if MODE == "val_returned":
            self.reached()
            return {"loss" if r == 0 else "zzz": torch.tensor(2.4 if r == 0 else 100.0)}
        if MODE == "empty_val":
            self.reached()
            self.log("val_loss", 2.4, sync_dist=True)
        if MODE == "order":
            first, second = ("va", "vb") if r == 0 else ("vb", "va")
            values = {"va": 1.0 + 10 * r, "vb": 100.0 + r}
            self.log(first, values[first], sync_dist=True)
            self.log(second, values[second], sync_dist=True)
            returned = {"ra": torch.tensor(3.0 + 2 * r), "rb": torch.tensor(50.0 + 4 * r)}
            return returned if r == 0 else dict(reversed(list(returned.items())))
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    train, val = PerRank([4, 4]), PerRank([2, 2])
    flags = {}
    if MODE == "train_lengths":
        train = PerRank([4, 3])
        print(f"REACHED {time.time()}", flush=True)
    if MODE == "empty_val":
        val = PerRank([2, 0])
    if MODE == "step_names_every_step":
        flags["log_every_n_steps"] = 1
    trainer = cardcage.Trainer(
        distributed_backend="ddp_spawn",
        num_processes=2,
        max_epochs=1,
        progress_bar=False,
        logger=False,
        num_sanity_val_steps=0,
        **flags,
    )
    trainer.fit(Model(), train, val)
    print("LOGGED " + json.dumps(trainer.logged_metrics), flush=True)
'''


def run_mode(harness: Harness, mode: str) -> dict[str, Any]:
    """Run the script in ``mode``; its exit status, output, what it logged, and how long
    after the first rank reached the mismatched point the job ended."""
    harness.root.mkdir(parents=True, exist_ok=True)
    script = harness.root / "agreement_job.py"
    script.write_text(textwrap.dedent(SCRIPT))
    # a hang is a failure of the test long before the default 1800 s
    run = harness.start(
        [sys.executable, str(script), mode], harness.env(CARDCAGE_TIMEOUT="90"), mode
    )
    code = run.wait(timeout=RUN_TIMEOUT)
    ended = time.time()
    output = run.stdout + run.stderr
    reached = [float(t) for t in re.findall(r"^REACHED (\S+)$", run.stdout, re.M)]
    logged = [line for line in run.stdout.splitlines() if line.startswith("LOGGED ")]
    harness.assert_no_leftovers()
    return {
        "code": code,
        "output": output,
        "after": ended - min(reached) if reached else None,
        "logged": json.loads(logged[-1].partition(" ")[2]) if logged else None,
    }


SCENARIOS: dict[str, Callable[[Harness], Any]] = {
    mode: (lambda h, m=mode: run_mode(h, m))
    for mode in (
        "val_names",
        "val_returned",
        "step_names",
        "step_names_every_step",
        "train_lengths",
        "empty_val",
        "order",
    )
}


class Scenarios:
    def __init__(self, root: Path, names: list[str]) -> None:
        self.harnesses = {name: Harness(root / name) for name in names}
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="scenario")
        self.futures: dict[str, Future[Any]] = {
            name: self.pool.submit(SCENARIOS[name], harness)
            for name, harness in self.harnesses.items()
        }

    def result(self, name: str) -> Any:
        return self.futures[name].result()

    def close(self) -> dict[str, dict[int, str]]:
        self.pool.shutdown(wait=True, cancel_futures=True)
        return {name: left for name, h in self.harnesses.items() if (left := h.cleanup())}


@pytest.fixture(scope="module")
def scenarios(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Scenarios]:
    names: list[str] = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if getattr(item, "module", None) is request.module and callspec is not None:
            name = callspec.params.get("scenario")
            if name is not None and name not in names:
                names.append(name)
    runner = Scenarios(tmp_path_factory.mktemp("agreement"), names)
    yield runner
    left = runner.close()
    assert not left, f"processes left behind by the scenarios: {left}"


def refused(result: dict[str, Any], *said: str) -> str:
    """The job failed with a MisconfigurationError saying each of ``said``, soon after the
    mismatched point."""
    output = result["output"]
    assert result["code"] != 0, f"the job exited 0, logging {result['logged']}\n{output[-4000:]}"
    assert "MisconfigurationError" in output, output[-4000:]
    for text in said:
        assert text in output, f"{text!r} not in the refusal\n{output[-4000:]}"
    assert result["after"] is not None and result["after"] < REFUSED_WITHIN, (
        f"refused {result['after']} s after the mismatched point, not within {REFUSED_WITHIN}"
    )
    return str(output)


@pytest.mark.parametrize("scenario", ["val_names"])
def test_different_names_logged_in_validation_step_are_refused_by_name(
    scenarios: Scenarios, scenario: str
) -> None:
    """Rank 1 logs zzz=100 where rank 0 logs val_loss=2.4 (sync_dist): before, val_loss
    was 51.2 and the job exited 0; now each rank's names and the hook are named."""
    refused(scenarios.result(scenario), "rank 0 ['val_loss']", "rank 1 ['zzz']", "validation_step")


@pytest.mark.parametrize("scenario", ["val_returned"])
def test_different_names_returned_from_validation_step_are_refused_by_name(
    scenarios: Scenarios, scenario: str
) -> None:
    """The same with the dicts validation_step returns (the loop's reduction of them)."""
    refused(scenarios.result(scenario), "'val_loss (returned)'", "'val_zzz (returned)'")


@pytest.mark.parametrize("scenario", ["step_names"])
def test_different_on_step_sync_dist_names_are_refused(scenarios: Scenarios, scenario: str) -> None:
    """On-step sync_dist values, each reduced in a collective of its own, whose names differ:
    caught from the digest each collective carries, at the epoch's end, each rank named."""
    refused(
        scenarios.result(scenario),
        "sync_dist=True on a step in training_step",
        "rank 0 ['train_a']; rank 1 ['zzz']",
    )


@pytest.mark.parametrize("scenario", ["step_names_every_step"])
def test_different_on_step_sync_dist_names_are_refused_when_the_steps_are_read(
    scenarios: Scenarios, scenario: str
) -> None:
    """log_every_n_steps=1: caught when the first step's values are read (before the
    logger gets them) on each rank alone, no collective: this rank's names named."""
    refused(
        scenarios.result(scenario),
        "sync_dist=True on a step in training_step",
        "and another rank other names",
    )


@pytest.mark.parametrize("scenario", ["train_lengths"])
def test_train_loaders_of_different_lengths_are_refused_naming_them(
    scenarios: Scenarios, scenario: str
) -> None:
    """Rank 1's train loader has 3 batches, rank 0's 4: refused before the first step (it
    waited for CARDCAGE_TIMEOUT in rank 0's fourth step before)."""
    refused(scenarios.result(scenario), "rank 0 4, rank 1 3", "batches per epoch")


@pytest.mark.parametrize("scenario", ["empty_val"])
def test_a_validation_loader_empty_on_one_rank_is_refused_by_name(
    scenarios: Scenarios, scenario: str
) -> None:
    """Rank 1's validation loader yields nothing: rank 0 logged val_loss, rank 1 nothing,
    and the message says rank 1 ran 0 validation batches."""
    refused(
        scenarios.result(scenario),
        "rank 0 ['val_loss'] (validation batches per loader: [2])",
        "rank 1 nothing (validation batches per loader: [0])",
    )


@pytest.mark.parametrize("scenario", ["order"])
def test_the_same_names_in_another_order_reduce_each_name_with_itself(
    scenarios: Scenarios, scenario: str
) -> None:
    """Each rank logs (and returns) the same names in another order: every mean is the mean
    of what the two ranks logged under that name (equal batch sizes on both ranks)."""
    result = scenarios.result(scenario)
    assert result["code"] == 0, result["output"][-4000:]
    logged = result["logged"]
    wanted = {
        "ta": (1.0 + 11.0) / 2,
        "tb": (100.0 + 101.0) / 2,
        "va": (1.0 + 11.0) / 2,
        "vb": (100.0 + 101.0) / 2,
        "val_ra": (3.0 + 5.0) / 2,
        "val_rb": (50.0 + 54.0) / 2,
    }
    for name, value in wanted.items():
        assert logged.get(name) == pytest.approx(value, abs=1e-6), (name, logged)
