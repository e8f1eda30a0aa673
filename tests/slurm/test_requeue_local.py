"""Checkpoint-and-requeue without SLURM daemons: ranks started by hand with SLURM's variables,
and a fake ``scontrol`` that records the requeue. Fast steps make the ranks' stop agreement
race the training loop; every interrupted run must resume to the uninterrupted weights.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import cardcage
from cardcage.train import requeue, stop_step

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

WORKER = Path(__file__).resolve().parent / "scripts" / "requeue_worker.py"
JOB_ID = "4242"
STEPS = 2 * 512 // 4  # 2 epochs of 512 samples, batch 4, one process


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_job(
    folder: Path,
    world: int,
    *args: str,
    restart: int = 0,
    scontrol_rc: int = 0,
    extra_env: dict[str, str] | None = None,
    out: str = "weights.pt",
) -> list[subprocess.CompletedProcess[str]]:
    """Every rank of one fake SLURM job (``SLURM_NTASKS=world``), run to its end."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {folder}/scontrol.log\nexit {scontrol_rc}\n')
    scontrol.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CARDCAGE_"))}
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        base.pop(name, None)
    base.update(
        {
            "PATH": f"{bin_dir}{os.pathsep}{base.get('PATH', '')}",
            "SLURM_JOB_ID": JOB_ID,
            "SLURM_JOB_NAME": "worker",
            "SLURM_NTASKS": str(world),
            "SLURM_NODEID": "0",
            "SLURM_NODELIST": "localhost",
            "SLURM_SUBMIT_DIR": str(folder),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            **(extra_env or {}),
        }
    )
    if restart:
        base["SLURM_RESTART_COUNT"] = str(restart)
    command = [
        sys.executable,
        str(WORKER),
        "--num-processes",
        str(world),
        "--out",
        str(folder / out),
        *args,
    ]
    processes = [
        subprocess.Popen(
            command,
            env={**base, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)},
            cwd=folder,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    results = []
    try:
        for rank, process in enumerate(processes):
            stdout, stderr = process.communicate(timeout=240)
            results.append(subprocess.CompletedProcess(command, process.returncode, stdout, stderr))
            print(f"--- rank {rank} (exit {process.returncode}) ---\n{stderr}")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return results


def max_difference(a: Path, b: Path) -> float:
    x, y = torch.load(a), torch.load(b)
    return max(float((x[k] - y[k]).abs().max()) for k in x)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The uninterrupted runs, with one and with two ranks."""
    weights = {}
    for world in (1, 2):
        folder = tmp_path_factory.mktemp(f"straight{world}")
        results = run_job(folder, world)
        assert [r.returncode for r in results] == [0] * world, [r.stderr for r in results]
        assert "requeue" not in "".join(r.stderr for r in results)
        weights[world] = folder / "weights.pt"
    return weights


def interrupted_then_resumed(
    folder: Path, world: int, *args: str, extra_env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Run with a requeue signal, check the requeue, run the restart; (stop step, logs)."""
    first = run_job(folder, world, *args, extra_env=extra_env)
    logs = "".join(r.stderr for r in first)
    assert [r.returncode for r in first] == [requeue.REQUEUED_EXIT_STATUS] * world, logs
    assert (folder / "scontrol.log").read_text().split() == ["requeue", JOB_ID]
    saved = re.search(r"checkpoint at global step (\d+) ", first[0].stderr)
    assert saved, logs
    step = int(saved.group(1))
    assert 0 < step < STEPS // world
    checkpoint = folder / f"cardcage-requeue-{JOB_ID}.ckpt"
    assert checkpoint.exists()
    assert torch.load(checkpoint, weights_only=True)["global_step"] == step
    assert not (folder / "weights.pt").exists()  # fit did not return

    second = run_job(folder, world, *args, restart=1, extra_env=extra_env)
    logs += "".join(r.stderr for r in second)
    assert [r.returncode for r in second] == [0] * world, logs
    assert f"restart 1: resumed from {checkpoint} at global step {step} " in second[0].stderr
    for result in second:
        assert f"worker: finished at global step {STEPS // world}" in result.stdout
    return step, logs


def test_one_process_requeues_and_resumes(straight: dict[int, Path], tmp_path: Path) -> None:
    """One process, and another signal (USR1 is the two-rank tests' and the cluster's)."""
    env = {"CARDCAGE_REQUEUE_SIGNAL": "USR2"}
    step, logs = interrupted_then_resumed(
        tmp_path, 1, "--signal-step", "100", "--signal", "USR2", extra_env=env
    )
    assert step >= 100
    assert "rank 0 received SIGUSR2" in logs
    assert max_difference(tmp_path / "weights.pt", straight[1]) <= 1e-6


@pytest.mark.parametrize(("signal_rank", "margin"), [(1, None), (0, 0.0)])
def test_two_ranks_agree_on_the_stop_step(
    straight: dict[int, Path], tmp_path: Path, signal_rank: int, margin: float | None
) -> None:
    """One rank is signalled; both stop after the same step (margin 0: likely retried)."""
    args = ["--signal-step", "60", "--signal-rank", str(signal_rank)]
    if margin is not None:
        args += ["--margin", str(margin)]
    step, logs = interrupted_then_resumed(tmp_path, 2, *args)
    assert f"rank {signal_rank} received SIGUSR1" in logs
    assert f"rank {1 - signal_rank} received" not in logs  # one signalled rank is enough
    agreed = re.findall(r"all 2 ranks stop after global step (\d+)|stopping at (\d+)", logs)
    assert agreed and int(next(s for s in agreed[-1] if s)) == step, logs
    assert max_difference(tmp_path / "weights.pt", straight[2]) <= 1e-6


def test_fsdp_requeues_through_its_gathered_state(
    straight: dict[int, Path], tmp_path: Path
) -> None:
    """fsdp's requeue commit gathers the shards on every rank (its collective-safe
    ``gather_state``); the restart loads each rank's shard and ends at ddp's weights."""
    interrupted_then_resumed(tmp_path, 2, "--signal-step", "60", "--backend", "fsdp")
    state = torch.load(tmp_path / f"cardcage-requeue-{JOB_ID}.ckpt", weights_only=True)
    assert state["state_dict"]["net.0.weight"].shape == (16, 4)  # full, not a shard
    assert state["optimizers"][0]["state"], "the momentum buffers were not gathered"
    assert max_difference(tmp_path / "weights.pt", straight[2]) <= 1e-5


def test_failed_requeue_keeps_the_checkpoint_and_a_first_run_ignores_it(
    straight: dict[int, Path], tmp_path: Path
) -> None:
    results = run_job(tmp_path, 1, "--signal-step", "50", scontrol_rc=1)
    assert results[0].returncode == requeue.REQUEUED_EXIT_STATUS
    assert "could not requeue job 4242" in results[0].stderr
    assert "resume_from_checkpoint=" in results[0].stderr
    assert (tmp_path / f"cardcage-requeue-{JOB_ID}.ckpt").exists()
    # A checkpoint under this job id on a job's first run comes from a recycled job id.
    again = run_job(tmp_path, 1, restart=0)
    assert again[0].returncode == 0, again[0].stderr
    assert "ignoring" in again[0].stderr and "restart count 0" in again[0].stderr
    assert max_difference(tmp_path / "weights.pt", straight[1]) <= 1e-6


def test_requeue_directory_and_off_switch(tmp_path: Path) -> None:
    elsewhere = tmp_path / "checkpoints"
    results = run_job(
        tmp_path,
        1,
        "--signal-step",
        "50",
        "--root",
        str(tmp_path / "root"),
        extra_env={"CARDCAGE_REQUEUE_DIR": str(elsewhere)},
    )
    assert results[0].returncode == requeue.REQUEUED_EXIT_STATUS
    assert (elsewhere / f"cardcage-requeue-{JOB_ID}.ckpt").exists()  # wins over the root dir
    # Turned off, SIGUSR1 keeps its default action: the process dies of it.
    off = run_job(tmp_path, 1, "--signal-step", "50", extra_env={"CARDCAGE_REQUEUE_SIGNAL": "none"})
    assert off[0].returncode == -signal.SIGUSR1, off[0].stderr


def test_bad_requeue_signal_is_a_misconfiguration(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_JOB_ID", "17")
    monkeypatch.setenv("SLURM_JOB_NAME", "job")
    monkeypatch.setenv("CARDCAGE_REQUEUE_SIGNAL", "SIGBOGUS")
    with pytest.raises(cardcage.MisconfigurationError, match="CARDCAGE_REQUEUE_SIGNAL"):
        cardcage.Trainer()
    monkeypatch.setenv("CARDCAGE_REQUEUE_SIGNAL", "12")
    trainer = cardcage.Trainer()
    assert trainer.selection.cluster == "slurm"
    assert trainer.selection.environment is not None
    assert trainer.selection.environment.requeue_signal() == signal.SIGUSR2


class FakeTrainer:
    """What the agreement reads of a trainer; ``jump`` plays a loop that passes the stop step
    between the watcher's write of ``stop_at_step`` and its read of ``global_step``."""

    def __init__(self, rank: int, world: int, step: int, jump: bool = False):
        self.accelerator = SimpleNamespace(global_rank=rank, world_size=world)
        self.global_step = step
        self.jump = jump
        self._stop = requeue.NEVER

    @property
    def stop_at_step(self) -> int:
        return self._stop

    @stop_at_step.setter
    def stop_at_step(self, value: int) -> None:
        self._stop = value
        if self.jump and value > self.global_step:
            self.global_step = value + 1  # the loop got there (and one further) first
            self.jump = False


def test_a_late_rank_moves_every_rank_to_a_later_step() -> None:
    """Deterministic: rank 1 passes round 0's step, so rank 0 (stopped there) carries on."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    trainers = [FakeTrainer(0, 2, 40), FakeTrainer(1, 2, 40, jump=True)]
    handlers = []
    for rank, trainer in enumerate(trainers):
        handler = requeue.RequeueHandler(
            SimpleNamespace(job_id=lambda: "1"), signal.SIGUSR1, Path("unused")
        )
        handler.trainer = trainer  # type: ignore[assignment]
        handler.rank, handler.world_size = rank, 2
        handler.prefix = "test/"
        handler.baseline = (time.monotonic(), trainer.global_step)
        handler.store = TCPStore("127.0.0.1", server.port, is_master=False)
        handlers.append(handler)
    clients = [TCPStore("127.0.0.1", server.port, is_master=False) for _ in handlers]
    threads = [
        threading.Thread(target=stop_step.agree, args=(handler, client), daemon=True)
        for handler, client in zip(handlers, clients, strict=True)
    ]
    for thread in threads:
        thread.start()
    server.add("test/request", 1)
    deadline = time.monotonic() + 30
    while not (server.check(["test/round/0"]) and 41 in handlers[0].rounds):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    first = int(server.get("test/round/0"))
    assert first == 41  # max(40, 40) + 1, no rate measured
    # Rank 0's loop reaches that step and waits there for the decision about it.
    trainers[0].global_step = first
    handlers[0].at_stop_step(trainers[0])  # a retry: returns instead of committing
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive()
    later = trainers[0].stop_at_step
    assert server.get("test/decision/0").decode() == f"retry {later}"
    assert later > first + 1 and trainers[1].stop_at_step == later
    assert server.get("test/decision/1").decode() == "commit"
    assert trainers[1].global_step < later
