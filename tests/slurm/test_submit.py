"""``cardcage submit`` / ``SlurmJob.submit`` on the private two-node cluster.

Every job runs ``train`` of tests/slurm/scripts/submit_train.py through submitit: each task
returns what SLURM gave it, what cardcage selected and what the process group used; rank 0
also returns the final weights, compared with a plain PyTorch loop with the same
hyperparameters. Tests read those results and the files in each job's folder, not only
states (a failed launch can still look finished).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from cardcage_submit import MANIFEST, POINT_FILE, RESULT_FILE, Grid, SlurmJob

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "slurm" / "scripts" / "submit_train.py"
TARGET = f"{SCRIPT}:train"
PYTHON = sys.executable
SAMPLES = 256  # submit_train.train's default
JOB_TIMEOUT = 360  # seconds; torch imports on 2 busy cores take a while


@pytest.fixture(scope="module")
def trainer_module() -> ModuleType:
    """tests/slurm/scripts/submit_train.py as a module (its plain reference loop)."""
    spec = importlib.util.spec_from_file_location("cardcage_tests_submit_train", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def cluster_env(slurm: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """This process talks to the private cluster (sbatch, squeue, scancel see SLURM_CONF)."""
    env = slurm.env
    for name in list(os.environ):
        if name.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_CONF", env["SLURM_CONF"])
    monkeypatch.setenv("PATH", env["PATH"])
    yield env


def cardcage(
    env: dict[str, str], *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "cardcage", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[key].double() - b[key].double()).abs().max()) for key in a)


def job_processes(folder: str) -> list[int]:
    """PIDs of the ``python -m submitit.core._submit FOLDER`` processes of one job."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and "submitit.core._submit" in argv and folder in argv:
            pids.append(int(entry.name))
    return pids


def submitted_script(folder: Path, job_id: str) -> str:
    return (folder / f"{job_id}_submission.sh").read_text()


# -- a 2x2 grid from Python: four jobs, each with its own hyperparameters ---------------------


def test_grid_of_four_jobs_each_trains_its_hyperparameters(
    cluster_env: dict[str, str], trainer_module: ModuleType, tmp_path: Path
) -> None:
    root = tmp_path / "grid"
    job = SlurmJob(time=10, job_name="cc-grid", trainer={"max_epochs": 2})
    grid = {"lr": [0.05, 0.1], "hidden": [8, 16]}
    planned = job.dry_run(TARGET, grid, folder=root)
    assert not root.exists()  # a dry run writes nothing
    started = time.monotonic()
    submitted = job.submit(TARGET, grid, folder=root)
    assert len(submitted.jobs) == 4
    ids = submitted.job_ids
    assert len(set(ids)) == 4, ids
    expected = [
        {"lr": 0.05, "hidden": 8},
        {"lr": 0.05, "hidden": 16},
        {"lr": 0.1, "hidden": 8},
        {"lr": 0.1, "hidden": 16},
    ]
    assert [job.hparams for job in submitted.jobs] == expected
    assert len({job.folder for job in submitted.jobs}) == 4

    # Collected afterwards, from the folder alone (as another process would).
    again = Grid.load(root)
    states = again.wait(timeout=JOB_TIMEOUT)
    elapsed = time.monotonic() - started
    results = again.results()
    logs = {job.job_id: (job.log(0, "err") or Path("-")) for job in again.jobs}
    assert states == ["COMPLETED"] * 4, (states, [r.error for r in results], logs)

    weights = []
    for item, result, plan in zip(again.jobs, results, planned, strict=True):
        assert result.ok, result.error
        value = result.value
        assert value["hparams"] == item.hparams == plan.hparams
        assert value["job_id"] == item.job_id and value["restart"] == 0
        assert value["selection"]["cluster"] == "slurm"
        assert value["selection"]["world_size"] == 1
        assert value["global_step"] == 2 * SAMPLES // 32
        reference = trainer_module.plain_loop(
            item.hparams["lr"], item.hparams["hidden"], SAMPLES, 32, 2
        )
        assert max_difference(value["weights"], reference) <= 1e-5
        weights.append(value["weights"])
        # Next to its results: the hyperparameters it ran with, its logs, its script.
        recorded = json.loads((item.folder / POINT_FILE).read_text())
        assert recorded["hparams"] == item.hparams and recorded["job_id"] == item.job_id
        assert recorded["trainer_flags"] == {"max_epochs": 2, "num_nodes": 1}
        outcome = json.loads((item.folder / RESULT_FILE).read_text())
        assert outcome["hparams"] == item.hparams and outcome["job_id"] == item.job_id
        assert torch.load(item.folder / "weights.pt").keys() == reference.keys()
        log = item.log(0, "out")
        assert log is not None and log.parent == item.folder and log.exists()
        assert item.job_id is not None
        assert submitted_script(item.folder, item.job_id) == plan.script
        assert "#SBATCH --ntasks-per-node=1\n" in plan.script
    # Different hyperparameters, different training.
    assert max_difference(weights[0], weights[2]) > 1e-3
    assert weights[0]["net.0.weight"].shape != weights[1]["net.0.weight"].shape
    manifest = json.loads((root / MANIFEST).read_text())
    assert [entry["job_id"] for entry in manifest["jobs"]] == ids
    print(f"2x2 grid: four jobs submitted, run and collected in {elapsed:.1f}s")


# -- a two-node job from the command line ----------------------------------------------------


def test_two_node_job_from_the_command_line_uses_slurm_ranks(
    cluster_env: dict[str, str], trainer_module: ModuleType, tmp_path: Path
) -> None:
    root = tmp_path / "two-nodes"
    arguments = [
        "submit",
        TARGET,
        "--nodes",
        "2",
        "--num-processes",
        "2",
        "--max-epochs",
        "2",
        "--time",
        "00:10:00",
        "--job-name",
        "cc-two-nodes",
        "--setup",
        "export CARDCAGE_TEST_SETUP=ran",
        "--grid",
        "lr=0.05",
        "--grid",
        "hidden=32",
        "--folder",
        str(root),
    ]
    dry = cardcage(cluster_env, *arguments, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    document = json.loads(dry.stdout)
    assert document["plan"]["processes_per_node"] == 2 and document["plan"]["nodes"] == 2
    (planned,) = document["jobs"]
    script = planned["script"]
    for line in ("--nodes=2", "--ntasks-per-node=2", "--signal=USR1@90", "--requeue"):
        assert f"#SBATCH {line}\n" in script, script
    assert "export MASTER_PORT=$((15000 + SLURM_JOB_ID % 10000))" in script
    assert not root.exists()

    done = cardcage(cluster_env, *arguments)
    assert done.returncode == 0, done.stdout + done.stderr
    match = re.search(r"submitted job (\d+): lr=0.05 hidden=32 -> (\S+)", done.stdout)
    assert match, done.stdout
    job_id, folder = match.group(1), Path(match.group(2))
    assert submitted_script(folder, job_id) == script  # the dry run printed the exact script

    grid = Grid.load(root)
    states = grid.wait(timeout=JOB_TIMEOUT)
    (job,) = grid.jobs
    assert states == ["COMPLETED"], (states, grid.results()[0].error)
    tasks = job.task_results()
    assert len(tasks) == 4
    port = 15000 + int(job_id[-4:])
    for task, value in enumerate(tasks):
        given, chosen, group = value["slurm"], value["selection"], value["process_group"]
        rank, local, node = int(given["PROCID"]), int(given["LOCALID"]), int(given["NODEID"])
        assert rank == task and rank == 2 * node + local
        assert given["JOB_ID"] == job_id and given["NTASKS"] == "4"
        assert given["NODELIST"] == "n[1-2]"
        assert value["slurmd_nodename"] == f"n{node + 1}"  # ran on that node's slurmd
        assert chosen["cluster"] == "slurm" and chosen["processes_created_outside"] is True
        assert chosen["accelerator"] == "ddp"
        assert chosen["world_size"] == 4 == group["world_size"]
        assert chosen["global_rank"] == rank == group["rank"]
        assert chosen["local_rank"] == local and chosen["node_rank"] == node
        assert chosen["master_address"] == "n1"
        assert chosen["master_port"] == port == int(value["master_port_env"])
        assert value["global_step"] == 2 * SAMPLES // 32
    reference = trainer_module.plain_loop(0.05, 32, SAMPLES, 32, 2)
    assert max_difference(tasks[0]["weights"], reference) <= 1e-5
    assert "weights" not in tasks[1]

    status = cardcage(cluster_env, "jobs", str(root), "--json")
    assert status.returncode == 0, status.stderr
    (entry,) = json.loads(status.stdout)["jobs"]
    assert entry["state"] == "COMPLETED" and entry["job_id"] == job_id
    assert entry["hparams"] == {"lr": 0.05, "hidden": 32}


# -- `cardcage jobs`: status and cancellation ------------------------------------------------


def test_jobs_shows_status_and_cancels(cluster_env: dict[str, str], tmp_path: Path) -> None:
    root = tmp_path / "cancel"
    done = cardcage(
        cluster_env,
        "submit",
        TARGET,
        "--max-epochs",
        "1000",
        "--time",
        "10",
        "--job-name",
        "cc-cancel",
        "--grid",
        "lr=0.05",
        "--grid",
        "hidden=8",
        "--grid",
        "step_sleep=0.05",
        "--folder",
        str(root),
    )
    assert done.returncode == 0, done.stderr
    grid = Grid.load(root)
    (job_id,) = grid.job_ids
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while grid.states() != ["RUNNING"]:
            assert time.monotonic() < deadline, grid.states()
            time.sleep(0.5)
        shown = cardcage(cluster_env, "jobs", str(root))
        assert shown.returncode == 0, shown.stderr
        assert re.search(
            rf"^0\s+{job_id}\s+RUNNING\s+lr=0.05 hidden=8 step_sleep=0.05", shown.stdout, re.M
        ), shown.stdout
        (folder,) = [str(job.folder) for job in grid.jobs]
        assert job_processes(folder)  # training
        cancelled = cardcage(cluster_env, "jobs", str(root), "--cancel", "--json")
        assert cancelled.returncode == 0, cancelled.stderr
        assert json.loads(cancelled.stdout)["cancelled"] == [job_id]
        started = time.monotonic()
        assert grid.wait(timeout=60) == ["CANCELLED"]
        # submitit ignores SIGTERM; cardcage restores it, so scancel ends the task at once.
        while job_processes(folder) and time.monotonic() - started < 30:
            time.sleep(0.2)
        assert not job_processes(folder), "the job's process outlived scancel by 30 s"
        print(f"cancelled: no process left {time.monotonic() - started:.1f}s after scancel")
    finally:
        subprocess.run(["scancel", job_id], env=cluster_env, capture_output=True, timeout=30)
    after = cardcage(cluster_env, "jobs", str(root), "--json")
    (entry,) = json.loads(after.stdout)["jobs"]
    assert entry["state"] == "CANCELLED"
    (result,) = grid.results(wait=False)
    assert not result.ok and "CANCELLED" in str(result.error)
    again = cardcage(cluster_env, "jobs", str(root), "--cancel", "--json")
    assert json.loads(again.stdout)["cancelled"] == []  # nothing left to cancel


# -- checkpoint-and-requeue through submitit -------------------------------------------------


def test_requeue_signal_checkpoints_requeues_and_resumes(
    cluster_env: dict[str, str], slurm: Any, trainer_module: ModuleType, tmp_path: Path
) -> None:
    """``scancel --signal=USR1``: cardcage's handler (not submitit's) checkpoints and requeues;
    submitit runs the same grid point again, which resumes to the uninterrupted weights."""
    root = tmp_path / "requeue"
    marker = tmp_path / "marker"
    job = SlurmJob(time=10, job_name="cc-requeue", trainer={"max_epochs": 3})
    grid = job.submit(
        TARGET,
        {"lr": 0.05, "hidden": 16},
        folder=root,
        kwargs={"step_sleep": 0.1, "marker": str(marker), "marker_step": 5},
    )
    (job_id,) = grid.job_ids
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while not marker.exists():
            assert time.monotonic() < deadline, grid.states()
            assert grid.states()[0] in ("PENDING", "RUNNING"), grid.results(wait=False)[0].error
            time.sleep(0.2)
        signalled = subprocess.run(
            ["scancel", "--signal=USR1", job_id], env=cluster_env, capture_output=True, text=True
        )
        assert signalled.returncode == 0, signalled.stderr
        states = grid.wait(timeout=JOB_TIMEOUT)
    finally:
        subprocess.run(["scancel", job_id], env=cluster_env, capture_output=True, timeout=30)
    (item,) = grid.jobs
    log = (item.log(0, "err") or Path("-")).read_text()
    assert states == ["COMPLETED"], log
    assert slurm.job(int(job_id)).get("Restarts") == "1"
    saved = re.search(
        r"cardcage: requeue: checkpoint at global step (\d+) .* written to (\S+)", log
    )
    assert saved, log
    assert saved.group(2) == str(item.folder / f"cardcage-requeue-{job_id}.ckpt")
    assert f"job {job_id} restart 1: resumed from {saved.group(2)}" in log
    (result,) = grid.results()
    assert result.ok, result.error
    assert result.value["restart"] == 1 and result.value["global_step"] == 3 * SAMPLES // 32
    reference = trainer_module.plain_loop(0.05, 16, SAMPLES, 32, 3)
    assert max_difference(result.value["weights"], reference) <= 1e-5
