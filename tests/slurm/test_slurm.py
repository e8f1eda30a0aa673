"""cardcage under a real SLURM: srun and sbatch jobs on two nodes, an interactive allocation,
checkpoint-and-requeue on SIGUSR1, and a killed task ending the whole step.

Every job runs examples/slurm/train.py, which prints one ``cardcage-example:`` JSON line per
process with what SLURM gave it, what cardcage selected and what the process group used.
Tests read those lines and the weights, not only exit codes (a failed launch can exit 0).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "slurm" / "train.py"
SUBMIT = ROOT / "examples" / "slurm" / "submit.sbatch"
PYTHON = sys.executable
SAMPLES = 512  # the example's default
STEPS_PER_EPOCH = SAMPLES // 32
JOB_TIMEOUT = 360  # seconds; 4 torch processes on 2 busy cores take a while to import
MARK = "cardcage-example: "
TERMINAL_STATES = sys.modules["cardcage_tests_slurm_cluster"].TERMINAL_STATES  # conftest's


def tag() -> str:
    return uuid.uuid4().hex[:12]


def reports(text: str, label: str) -> list[dict[str, Any]]:
    """The report lines of processes run with ``--tag label``."""
    found = []
    for line in text.splitlines():
        if line.startswith(MARK):
            data = json.loads(line[len(MARK) :])
            if data["tag"] == label:
                found.append(data)
    return found


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[key].double() - b[key].double()).abs().max()) for key in a)


def training_processes(label: str) -> list[int]:
    """PIDs of python processes running the example with ``--tag label`` (srun excluded)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if state == "Z" or len(args) < 2 or Path(args[0]).name == "srun":
            continue
        if str(TRAIN) in args and label in args:
            pids.append(int(entry.name))
    return pids


def process_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    pairs = (item.decode(errors="replace").partition("=") for item in raw if b"=" in item)
    return {key: value for key, _, value in pairs}


def check_slurm_ranks(lines: list[dict[str, Any]], accelerator: str = "ddp") -> str:
    """Four ranks on n1 and n2, each using what SLURM gave it; returns the job id."""
    assert sorted(int(line["slurm"]["PROCID"]) for line in lines) == [0, 1, 2, 3], lines
    job_ids = {line["slurm"]["JOB_ID"] for line in lines}
    assert len(job_ids) == 1, job_ids
    job_id = job_ids.pop()
    port = 15000 + int(job_id[-4:])
    for line in lines:
        given, chosen, group = line["slurm"], line["selection"], line["process_group"]
        rank, local, node = int(given["PROCID"]), int(given["LOCALID"]), int(given["NODEID"])
        assert given["NODELIST"] == "n[1-2]"
        assert given["NTASKS"] == "4"
        assert rank == 2 * node + local
        assert line["slurmd_nodename"] == f"n{node + 1}"  # really ran on that node's slurmd
        assert chosen["cluster"] == "slurm" and chosen["processes_created_outside"] is True
        assert chosen["accelerator"] == accelerator
        assert chosen["world_size"] == 4 == group["world_size"]
        assert chosen["global_rank"] == rank == group["rank"]
        assert chosen["local_rank"] == local
        assert chosen["node_rank"] == node
        # The first host of n[1-2], brackets expanded; the port from the job id: used.
        assert chosen["master_address"] == "n1" == group["store_host"] == group["MASTER_ADDR"]
        assert chosen["master_port"] == port == group["store_port"] == int(group["MASTER_PORT"])
    return job_id


def submit(slurm: Any, folder: Path, label: str, *args: str) -> int:
    """examples/slurm/submit.sbatch, 3 epochs, its log in ``folder/job.out``."""
    return int(
        slurm.sbatch(
            f"--output={folder}/job.out",
            f"--chdir={folder}",
            str(SUBMIT),
            "--epochs",
            "3",
            "--root",
            str(folder),
            "--out",
            str(folder / "weights.pt"),
            "--tag",
            label,
            *args,
            env={"PYTHON": PYTHON, "CARDCAGE_EXAMPLE": str(TRAIN)},
        )
    )


def wait_for_file(path: Path, deadline_s: float, alive: Any) -> None:
    deadline = time.monotonic() + deadline_s
    while not path.exists():
        assert alive(), f"the job ended before {path.name} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear within {deadline_s}s"
        time.sleep(0.1)


# -- srun: SLURM starts the four processes --------------------------------------------------


@pytest.mark.parametrize("backend", ["ddp", "auto"])
def test_srun_two_nodes_two_tasks_each(
    slurm: Any, example: ModuleType, tmp_path: Path, backend: str
) -> None:
    """``srun -N2 --ntasks-per-node=2``: four ranks from SLURM; batch 8 each = batch 32."""
    label = tag()
    weights = tmp_path / "weights.pt"
    done = slurm.srun(
        "-N2",
        "--ntasks-per-node=2",
        "--kill-on-bad-exit=1",
        "--job-name=cardcage-srun",
        PYTHON,
        str(TRAIN),
        "--backend",
        backend,
        "--epochs",
        "2",
        "--out",
        str(weights),
        "--tag",
        label,
        timeout=JOB_TIMEOUT,
        cwd=tmp_path,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    lines = reports(done.stdout, label)
    assert len(lines) == 4, output
    check_slurm_ranks(lines)
    rule = {line["selection"]["rule"] for line in lines}
    # Named: the flag decides. Not named: rule 300 (a cluster created the processes) picks ddp.
    assert rule == ({"distributed_backend"} if backend == "ddp" else {"multi_node_or_cluster"})
    assert all(line["global_step"] == 2 * STEPS_PER_EPOCH for line in lines)
    reference = example.plain_loop(SAMPLES, 32, 2)
    assert max_difference(torch.load(weights), reference) <= 1e-5
    assert not training_processes(label)


# -- sbatch ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(slurm: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """examples/slurm/submit.sbatch run to the end: the reference of the requeue test."""
    folder = tmp_path_factory.mktemp("sbatch")
    label = tag()
    job = submit(slurm, folder, label)
    state = slurm.wait_done(job, JOB_TIMEOUT)
    log = (folder / "job.out").read_text() if (folder / "job.out").exists() else ""
    return {"job": job, "state": state, "folder": folder, "log": log, "label": label}


def test_sbatch_two_nodes(uninterrupted: dict[str, Any], example: ModuleType) -> None:
    """The submit script: COMPLETED, four ranks from SLURM, the weights of batch 32."""
    log = uninterrupted["log"]
    assert uninterrupted["state"] == "COMPLETED", log
    job = uninterrupted["job"]
    assert f"job {job} on n[1-2], restart 0" in log
    lines = reports(log, uninterrupted["label"])
    assert len(lines) == 4, log
    assert check_slurm_ranks(lines) == str(job)
    assert all(line["global_step"] == 3 * STEPS_PER_EPOCH for line in lines)
    assert "requeue" not in log
    weights = torch.load(uninterrupted["folder"] / "weights.pt")
    assert max_difference(weights, example.plain_loop(SAMPLES, 32, 3)) <= 1e-5


def test_requeue_on_sigusr1_resumes_to_the_same_weights(
    slurm: Any, uninterrupted: dict[str, Any], tmp_path: Path
) -> None:
    """``scancel --signal=USR1`` partway: checkpoint, requeue, resume, same final weights."""
    assert uninterrupted["state"] == "COMPLETED", uninterrupted["log"]
    label = tag()
    marker = tmp_path / "marker"
    job = submit(
        slurm,
        tmp_path,
        label,
        "--step-sleep",
        "0.1",
        "--marker",
        str(marker),
        "--marker-step",
        "10",
    )
    try:
        wait_for_file(marker, JOB_TIMEOUT, lambda: slurm.job_state(job) in ("PENDING", "RUNNING"))
        signalled = slurm.run(["scancel", "--signal=USR1", str(job)], timeout=30)
        assert signalled.returncode == 0, signalled.stderr
        state = slurm.wait_done(job, JOB_TIMEOUT)
    finally:
        if slurm.job_state(job) not in TERMINAL_STATES:
            slurm.run(["scancel", str(job)], timeout=30)
    log = (tmp_path / "job.out").read_text()
    assert state == "COMPLETED", log
    assert slurm.job(job).get("Restarts") == "1", slurm.job(job)

    saved = re.search(
        r"cardcage: requeue: checkpoint at global step (\d+) \(epoch 0, batch (\d+)\) "
        r"written to (\S+)",
        log,
    )
    assert saved, log
    step = int(saved.group(1))
    assert 10 < step < 3 * STEPS_PER_EPOCH, log  # partway: after the marker, before the end
    assert saved.group(3) == str(tmp_path / f"cardcage-requeue-{job}.ckpt")
    assert "received SIGUSR1" in log
    assert f"cardcage: requeue: requeued job {job}" in log
    resumed = f"job {job} restart 1: resumed from {saved.group(3)} at global step {step} "
    assert resumed in log, log
    # In this order: the first run, its checkpoint, the restart, the resume.
    positions = [
        log.index(f"job {job} on n[1-2], restart 0"),
        saved.start(),
        log.index(f"job {job} on n[1-2], restart 1"),
        log.index(resumed),
    ]
    assert positions == sorted(positions), log
    lines = reports(log, label)
    assert len(lines) == 4, log  # only the restarted run finishes
    check_slurm_ranks(lines)
    assert all(line["slurm"]["RESTART_COUNT"] == "1" for line in lines)
    assert all(line["global_step"] == 3 * STEPS_PER_EPOCH for line in lines)

    interrupted = torch.load(tmp_path / "weights.pt")
    straight = torch.load(uninterrupted["folder"] / "weights.pt")
    assert max_difference(interrupted, straight) <= 1e-6
    assert not training_processes(label)


# -- an interactive allocation: cardcage starts its own processes ----------------------------


@pytest.mark.parametrize("backend", ["ddp", "ddp_spawn"])
def test_interactive_allocation_launches_its_own_processes(
    slurm: Any, example: ModuleType, tmp_path: Path, backend: str
) -> None:
    """One task named ``bash``: SLURM does not manage tasks; cardcage starts 2 processes."""
    label = tag()
    weights = tmp_path / "weights.pt"
    done = slurm.srun(
        "-N1",
        "-n1",
        "--cpus-per-task=2",
        "--job-name=bash",
        "--kill-on-bad-exit=1",
        PYTHON,
        str(TRAIN),
        "--num-nodes",
        "1",
        "--num-processes",
        "2",
        "--backend",
        backend,
        "--epochs",
        "2",
        "--out",
        str(weights),
        "--tag",
        label,
        timeout=JOB_TIMEOUT,
        cwd=tmp_path,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    lines = reports(done.stdout, label)
    launcher = [line for line in lines if line["selection"]["cluster"] == "local"]
    assert len(launcher) == 1, output
    first = launcher[0]
    assert first["slurm"]["JOB_NAME"] == "bash" and first["slurm"]["NTASKS"] == "1"
    assert first["selection"]["processes_created_outside"] is False
    assert first["selection"]["accelerator"] == backend
    assert first["selection"]["world_size"] == 2
    if backend == "ddp":
        # The task trains as rank 0 and re-ran the script for rank 1.
        assert len(lines) == 2, output
        assert sorted(line["process_group"]["rank"] for line in lines) == [0, 1]
        assert first["process_group"]["rank"] == 0
        child = next(line for line in lines if line is not first)
        assert child["selection"]["cluster"] == "torchelastic"  # env:// from the relaunch
        assert child["pid"] != first["pid"]
    else:
        assert len(lines) == 1, output  # spawned workers hand their weights back
    reference = example.plain_loop(SAMPLES, 16, 2)
    assert max_difference(torch.load(weights), reference) <= 1e-5
    assert not training_processes(label)


# -- a task that dies, or a cancelled job, ends the whole step --------------------------------


@pytest.mark.parametrize("how", ["sigkill-one-task", "scancel"])
def test_a_dead_task_or_cancel_ends_every_rank(slurm: Any, tmp_path: Path, how: str) -> None:
    """SIGKILL of one task under ``srun -K`` (or SIGTERM from scancel): all gone within 30 s."""
    label = tag()
    marker = tmp_path / "marker"
    command = [
        "srun",
        "--immediate=10",
        "-N2",
        "--ntasks-per-node=2",
        "--kill-on-bad-exit=1",
        f"--job-name=cardcage-{how}",
        PYTHON,
        str(TRAIN),
        "--epochs",
        "1000",
        "--step-sleep",
        "0.05",
        "--marker",
        str(marker),
        "--marker-step",
        "5",
        "--tag",
        label,
    ]
    process = subprocess.Popen(
        command,
        env=slurm.env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_file(marker, JOB_TIMEOUT, lambda: process.poll() is None)
        pids = training_processes(label)
        assert len(pids) == 4, pids
        ranks = {int(process_env(pid)["SLURM_PROCID"]): pid for pid in pids}
        job = process_env(pids[0])["SLURM_JOB_ID"]
        started = time.monotonic()
        if how == "sigkill-one-task":
            os.kill(ranks[3], signal.SIGKILL)
        else:
            done = slurm.run(["scancel", job], timeout=30)
            assert done.returncode == 0, done.stderr
        try:
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"srun still running 30 s after {how}; left: {training_processes(label)}")
        while training_processes(label) and time.monotonic() - started < 30:
            time.sleep(0.1)
        elapsed = time.monotonic() - started
        left = training_processes(label)
        assert not left, f"processes left {elapsed:.1f}s after {how}: {left}\n{output}"
        assert elapsed <= 30, output
        assert process.returncode != 0, output
        if how == "sigkill-one-task":
            assert re.search(r"task 3: Killed", output), output
        else:
            assert "CANCELLED" in output, output
        print(f"{how}: srun ended and no process left {elapsed:.1f}s after")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for pid in training_processes(label):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
