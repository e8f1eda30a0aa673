"""What the job's processes could not survive fails the job at once, in the process that
called ``fit``, before any process is started: a rendezvous host that does not resolve, a
``MASTER_PORT`` already in use, a ``CARDCAGE_*`` timeout longer than torch can wait.

Caught late, each costs minutes and hides its cause: a rendezvous host that does not
resolve leaves the ranks waiting for each other until the rendezvous times out, a port in
use fails in a worker with ``EADDRINUSE``, and a timeout torch cannot wait makes the workers
time out at once. Each job here is a real script in a fresh process; every process it
starts carries the harness's marker, and a scan of ``/proc`` finds any left.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cardcage.testing import harness as kit_harness

pytestmark = pytest.mark.slow

UNRESOLVABLE = "no-such-host.invalid"  # RFC 2606: .invalid never resolves
#: The refusal must come this fast (start-up, torch's import included, is most of it).
DEADLINE = 15.0

SCRIPT = """
import os
import sys

# Every process that runs this file says so: the launcher, a relaunched child, and a
# spawned worker (spawn imports the main module again).
with open(os.environ["EARLY_STARTS"], "a") as starts:
    starts.write(f"{os.getpid()} {os.environ.get('RANK', '-')}\\n")

import torch

import cardcage


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=2
    )
    trainer = cardcage.Trainer(
        distributed_backend=sys.argv[1], num_processes=2, max_epochs=1, progress_bar=False
    )
    trainer.fit(Tiny(), data)
    print("TRAINED", trainer.selection.accelerator)
"""


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[kit_harness.Harness]:
    made = kit_harness.Harness(tmp_path / "jobs")
    try:
        yield made
    finally:
        made.cleanup()


def run_job(
    harness: kit_harness.Harness, tmp_path: Path, backend: str, **env: str
) -> tuple[kit_harness.Run, float, list[str]]:
    script = tmp_path / "early_job.py"
    script.write_text(SCRIPT)
    starts = tmp_path / f"starts-{backend}-{len(harness.runs)}.txt"
    started = time.monotonic()
    run = harness.start(
        [kit_harness.PYTHON, str(script), backend],
        harness.env(EARLY_STARTS=str(starts), **env),
        name=f"{backend} {env}",
    )
    run.wait(timeout=DEADLINE)  # fails the test (and kills the job) past the deadline
    took = time.monotonic() - started
    return run, took, starts.read_text().splitlines() if starts.exists() else []


@pytest.mark.parametrize("port", [None, "29517"], ids=["no MASTER_PORT", "MASTER_PORT"])
@pytest.mark.parametrize("backend", ["ddp", "ddp_spawn"])
def test_an_unresolvable_master_addr_fails_before_any_process_starts(
    harness: kit_harness.Harness, tmp_path: Path, backend: str, port: str | None
) -> None:
    env = {"MASTER_ADDR": UNRESOLVABLE, **({"MASTER_PORT": port} if port else {})}
    run, took, starts = run_job(harness, tmp_path, backend, **env)
    assert run.popen.returncode != 0, run.output()
    stderr = run.stderr
    assert "MisconfigurationError" in stderr, run.output()
    assert f"MASTER_ADDR={UNRESOLVABLE!r} does not resolve" in stderr, run.output()
    assert "Set MASTER_ADDR" in stderr
    assert took < DEADLINE
    assert len(starts) == 1, f"processes started besides the launcher: {starts}"
    harness.assert_no_leftovers()


@pytest.mark.parametrize("backend", ["ddp", "ddp_spawn"])
def test_a_master_port_in_use_fails_before_any_process_starts(
    harness: kit_harness.Harness, tmp_path: Path, backend: str
) -> None:
    # Another job's store holds the port (a listening socket on 127.0.0.1, as one is).
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        run, took, starts = run_job(harness, tmp_path, backend, MASTER_PORT=port)
    assert run.popen.returncode != 0, run.output()
    assert "MisconfigurationError" in run.stderr, run.output()
    assert f"MASTER_PORT={port} is already in use" in run.stderr, run.output()
    assert "Unset MASTER_PORT" in run.stderr
    assert took < DEADLINE
    assert len(starts) == 1, f"processes started besides the launcher: {starts}"
    harness.assert_no_leftovers()


@pytest.mark.parametrize("value", ["1e10", "1e308"])
@pytest.mark.parametrize("variable", ["CARDCAGE_TIMEOUT", "CARDCAGE_INIT_TIMEOUT"])
def test_a_timeout_longer_than_torch_can_wait_fails_before_any_process_starts(
    harness: kit_harness.Harness, tmp_path: Path, variable: str, value: str
) -> None:
    # 1e10 passed the check and every wait timed out at once ("Timed out waiting
    # 10000000030000ms"); 1e308 raised OverflowError from a rank or the store.
    run, took, starts = run_job(harness, tmp_path, "ddp_spawn", **{variable: value})
    assert run.popen.returncode != 0, run.output()
    assert "MisconfigurationError" in run.stderr, run.output()
    assert f"{variable}={value!r} is longer than torch can wait" in run.stderr, run.output()
    assert "the largest value that works is 1000000000 seconds" in run.stderr
    assert "OverflowError" not in run.stderr and "Timed out" not in run.stderr
    assert took < DEADLINE
    assert len(starts) == 1, f"processes started besides the launcher: {starts}"
    harness.assert_no_leftovers()


def test_the_longest_timeouts_train(harness: kit_harness.Harness, tmp_path: Path) -> None:
    # The bound is one that works: both timeouts at it, the job trains and exits 0.
    script = tmp_path / "early_job.py"
    script.write_text(SCRIPT)
    starts = tmp_path / "starts.txt"
    longest = {"CARDCAGE_TIMEOUT": "1e9", "CARDCAGE_INIT_TIMEOUT": "1e9"}
    run = harness.start(
        [kit_harness.PYTHON, str(script), "ddp_spawn"],
        harness.env(EARLY_STARTS=str(starts), **longest),
    )
    run.check(timeout=kit_harness.RUN_TIMEOUT)
    assert "TRAINED ddp_spawn" in run.stdout
    assert len(starts.read_text().splitlines()) == 3  # the launcher and two workers
    harness.assert_no_leftovers()


def test_a_master_addr_that_resolves_trains(harness: kit_harness.Harness, tmp_path: Path) -> None:
    # The check looks the name up and lets the job go on: both ranks start and train.
    script = tmp_path / "early_job.py"
    script.write_text(SCRIPT)
    starts = tmp_path / "starts.txt"
    run = harness.start(
        [kit_harness.PYTHON, str(script), "ddp"],
        harness.env(EARLY_STARTS=str(starts), MASTER_ADDR="localhost"),
    )
    run.check(timeout=kit_harness.RUN_TIMEOUT)
    assert "TRAINED ddp" in run.stdout
    assert len(starts.read_text().splitlines()) == 2
    harness.assert_no_leftovers()


SECOND_TRAINER = """
import os
import sys

sys.path.insert(0, sys.argv[1])
import restart_job

import cardcage

if __name__ == "__main__":
    sys.argv = ["restart_job.py", sys.argv[2], "ddp_spawn", "once", "1"]
    restart_job.main()  # rank 1 is killed once: one restart, from a temporary folder
    print("RESTART_FROM", os.environ.get("CARDCAGE_RESTART_FROM"))
    cardcage.Trainer(distributed_backend="ddp_spawn", num_processes=2)  # checks the variables
    print("SECOND TRAINER")
"""


def test_a_restart_leaves_no_restart_variable_for_the_next_trainer(
    harness: kit_harness.Harness, tmp_path: Path
) -> None:
    # CARDCAGE_RESTART_FROM named the removed temporary checkpoint after fit returned, so the
    # next Trainer of the script was refused (and its fit would have resumed from it).
    script = tmp_path / "second_trainer.py"
    script.write_text(SECOND_TRAINER)
    out = tmp_path / "out"
    out.mkdir()
    scripts = Path(__file__).resolve().parents[1] / "distributed" / "scripts"
    run = harness.start([kit_harness.PYTHON, str(script), str(scripts), str(out)])
    run.check(timeout=kit_harness.RUN_TIMEOUT)
    assert "restart 1 of max_restarts=1" in run.stderr
    assert "RESTART_FROM None" in run.stdout and "SECOND TRAINER" in run.stdout
    harness.assert_no_leftovers()
