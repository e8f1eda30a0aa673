"""``cardcage_submit`` without a cluster: grids, the planned layout, the exact sbatch scripts of
a dry run, validation errors, ``cardcage submit``/``cardcage jobs`` exit statuses, what a job
runs (``cardcage_submit.run._run_point``) and how states are read from SLURM's commands
(faked here).

The real submissions are in tests/slurm/test_submit.py.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import cardcage
import cardcage_submit as sub
from cardcage.sdk import REQUEUED_EXIT_STATUS
from cardcage_submit import Grid, SlurmJob
from cardcage_submit.run import _run_point
from cardcage_submit.sbatch import _python_command
from cardcage_submit.submission import _points

pytest.importorskip("submitit")

CLUSTER_PREFIXES = ("SLURM_", "SBATCH_", "TORCHELASTIC_", "OMPI_", "PMI_", "HOROVOD_", "CARDCAGE_")
CLUSTER_NAMES = ("WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "MASTER_ADDR")
CLUSTER_NAMES += ("MASTER_PORT", "PL_TRAINER_GPUS", "SUBMITIT_EXECUTOR")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(CLUSTER_PREFIXES) or name in CLUSTER_NAMES:
            monkeypatch.delenv(name)


@pytest.fixture
def function_file(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(
        textwrap.dedent(
            """
            import os, sys
            from cardcage_submit import current_run

            def train(lr, layers, extra=0):
                run = current_run()
                return {"lr": lr, "layers": layers, "extra": extra, "index": run.index,
                        "flags": run.trainer_flags, "folder": str(run.folder)}

            def rank_of_process():
                return os.environ.get("SLURM_PROCID")

            if __name__ == "__main__":
                code = int(sys.argv[1]) if len(sys.argv) > 1 else 0
                with open(os.environ["CARDCAGE_TEST_OUT"], "w") as out:
                    out.write(" ".join(sys.argv[1:]))
                sys.exit(code)
            """
        )
    )
    return path


def seed_job(**changes: Any) -> SlurmJob:
    """The seed's SlurmCluster example: 12 nodes x 8 GPUs, NCCL module, NCCL variables."""
    settings: dict[str, Any] = {
        "nodes": 12,
        "gpus_per_node": 8,
        "time": "0-02:00:00",
        "partition": "gpu",
        "job_name": "name_for_squeue",
        "modules": ["NCCL/2.4.7-1-cuda.10.0"],
        "setup": ["export NCCL_SOCKET_IFNAME=^docker0,lo", "export NCCL_DEBUG=INFO"],
        "trainer": {"max_epochs": 3},
    }
    settings.update(changes)
    return SlurmJob(**settings)


# -- grids -------------------------------------------------------------------------------------


def test_grid_expands_every_combination_first_name_slowest() -> None:
    points = sub.expand_grid({"learning_rate": [1e-3, 1e-2, 1e-1], "layers": [16, 32, 64]})
    assert len(points) == 9
    assert points[0] == {"learning_rate": 1e-3, "layers": 16}
    assert points[1] == {"learning_rate": 1e-3, "layers": 32}
    assert points[3] == {"learning_rate": 1e-2, "layers": 16}
    assert points[-1] == {"learning_rate": 1e-1, "layers": 64}
    assert sub.expand_grid(None) == [{}]
    assert sub.expand_grid({"lr": 0.1}) == [{"lr": 0.1}]  # a scalar is one value
    assert sub.expand_grid([{"lr": 1}, {"lr": 2, "layers": 3}]) == [
        {"lr": 1},
        {"lr": 2, "layers": 3},
    ]


def test_grid_option_parses_numbers_and_keeps_text() -> None:
    assert sub.parse_grid_option("lr=1e-3,1e-2") == ("lr", [0.001, 0.01])
    assert sub.parse_grid_option("layers= 16, 32,") == ("layers", [16, 32])
    assert sub.parse_grid_option("opt=adam,sgd") == ("opt", ["adam", "sgd"])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("lr", "--grid 'lr' is not NAME=VALUES"),
        ("=1,2", "is not NAME=VALUES"),
        ("lr=", "gives no value for 'lr'"),
        ("lr=,", "gives no value"),
    ],
)
def test_bad_grid_option(text: str, expected: str) -> None:
    with pytest.raises(cardcage.MisconfigurationError, match=expected):
        sub.parse_grid_option(text)


@pytest.mark.parametrize(
    ("grid", "expected"),
    [
        ({"lr": []}, r"grid lr=\[\] has no value"),
        ({"lr": [1, 1]}, "lists 1 twice"),
        ({"num_nodes": [1, 2]}, "'num_nodes' is a Trainer flag"),
        ({"max-epochs": [1]}, "'max-epochs' is not a Python identifier"),
        ({"lr": [[1, 2]]}, r"grid lr=\[1, 2\] is a list"),
        ([], r"grid=\[\] has no point"),
        ([1], "grid point 1 is not a mapping"),
    ],
)
def test_bad_grid(grid: Any, expected: str) -> None:
    with pytest.raises(cardcage.MisconfigurationError, match=expected):
        sub.expand_grid(grid)


@pytest.mark.parametrize(
    ("value", "minutes"),
    [
        (90, 90),
        ("90", 90),
        ("10:30", 11),
        ("01:30:00", 90),
        ("1-00", 1440),
        ("1-02:03", 1563),
        ("0-02:00:00", 120),
    ],
)
def test_time_limits(value: object, minutes: int) -> None:
    assert sub.parse_time(value) == minutes


@pytest.mark.parametrize("value", ["1h", "", "00:00:00", 0, -5, True, 1.5, "1-2-3"])
def test_bad_time_limits(value: object) -> None:
    with pytest.raises(cardcage.MisconfigurationError, match=r"time=.* \(--time\) is not a SLURM"):
        sub.parse_time(value)


# -- the layout: --ntasks-per-node from the selection rules ------------------------------------


@pytest.mark.parametrize(
    ("changes", "accelerator", "per_node"),
    [
        ({}, "ddp", 8),  # 12 nodes x 8 GPUs: one process per GPU
        ({"trainer": {"distributed_backend": "ddp2"}}, "ddp2", 1),  # one per node
        ({"nodes": 1}, "ddp", 8),  # rule 400 picks ddp_spawn; in the job SLURM made them: ddp
        ({"nodes": 2, "gpus_per_node": 0, "trainer": {"num_processes": 3}}, "ddp", 3),
        ({"nodes": 1, "gpus_per_node": 0, "trainer": {}}, "cpu", 1),
        ({"nodes": 1, "gpus_per_node": 2, "trainer": {"distributed_backend": "dp"}}, "dp", 1),
        (
            {
                "nodes": 1,
                "gpus_per_node": 0,
                "trainer": {"distributed_backend": "ddp_cpu", "num_processes": 2},
            },
            "ddp",
            2,
        ),
    ],
)
def test_processes_per_node_come_from_the_selection_rules(
    changes: dict[str, Any], accelerator: str, per_node: int, cuda_count_0: int
) -> None:
    plan = seed_job(**changes).plan()  # planned as on a node with gpus_per_node GPUs
    assert plan.accelerator == accelerator
    assert plan.processes_per_node == per_node
    assert plan.parameters["ntasks_per_node"] == per_node
    assert plan.parameters["nodes"] == plan.job.nodes == plan.trainer_flags["num_nodes"]
    import torch

    assert torch.cuda.device_count() == 0  # the patch during planning is gone


def test_gpus_flag_and_gpus_per_node_agree() -> None:
    plan = SlurmJob(trainer={"gpus": 2}).plan()
    assert plan.job.gpus_per_node == 2 and plan.trainer_flags["gpus"] == 2
    assert plan.parameters["gpus_per_node"] == 2  # SLURM is asked for them
    assert plan.processes_per_node == 2  # two GPUs on one node: one process each
    plan = SlurmJob(gpus_per_node=4, trainer={"gpus": -1}).plan()
    assert plan.trainer_flags["gpus"] == 4


def test_the_seed_example_dry_run_script(tmp_path: Path) -> None:
    grid = {"learning_rate": [1e-3, 1e-2, 1e-1], "layers": [16, 32, 64]}
    planned = seed_job().dry_run("cardcage.cli.demo:run", grid, folder=tmp_path / "grid")
    assert len(planned) == 9
    assert not (tmp_path / "grid").exists()  # a dry run writes nothing
    first = planned[0]
    assert first.hparams == {"learning_rate": 1e-3, "layers": 16}
    assert first.folder == tmp_path / "grid" / "000-learning_rate=0.001-layers=16"
    script = first.script
    assert script.startswith("#!/bin/bash\n")
    for line in (
        "--nodes=12",
        "--ntasks-per-node=8",
        "--gpus-per-node=8",
        "--time=120",
        "--partition=gpu",
        "--job-name=name_for_squeue",
        "--signal=USR1@90",
        "--requeue",
        "--open-mode=append",
        f"--output={first.folder}/%j_0_log.out",
        f"--error={first.folder}/%j_0_log.err",
    ):
        assert f"#SBATCH {line}\n" in script, line
    setup = script[script.index("# setup\n") : script.index("# command\n")]
    assert setup.splitlines()[3:] == [
        "export CARDCAGE_REQUEUE_SIGNAL=USR1",
        f"export CARDCAGE_REQUEUE_DIR={first.folder}",
        "export MASTER_PORT=$((15000 + SLURM_JOB_ID % 10000))",
        "module load NCCL/2.4.7-1-cuda.10.0",
        "export NCCL_SOCKET_IFNAME=^docker0,lo",
        "export NCCL_DEBUG=INFO",
        "",
    ]
    assert "# cardcage: job 1 of 9: learning_rate=0.001 layers=16" in setup
    command = script.splitlines()[-1]
    assert command.startswith("srun --unbuffered --output ")
    assert "--kill-on-bad-exit=1" in command
    assert command.endswith(f"-u -m submitit.core._submit {first.folder}")
    assert [item.index for item in planned] == list(range(9))
    assert len({item.folder for item in planned}) == 9


def test_dry_run_is_the_script_submitit_writes(tmp_path: Path) -> None:
    """The dry run's text is what SlurmExecutor would write for the same parameters."""
    import submitit

    (item,) = SlurmJob(time=30, master_port=29500, env={"A": "b c"}).dry_run(
        "cardcage.cli.demo:run", folder=tmp_path
    )
    executor = object.__new__(submitit.SlurmExecutor)
    submitit.core.core.PicklingExecutor.__init__(executor, item.folder)
    executor.python = _python_command(SlurmJob())
    executor.update_parameters(**item.parameters)
    text = executor._make_submission_file_text(executor._submitit_command_str, "uid")
    assert text == item.script
    assert "export MASTER_PORT=29500\n" in text and "export A='b c'\n" in text


def test_no_requeue_and_another_signal(tmp_path: Path) -> None:
    (off,) = SlurmJob(requeue=False).dry_run("cardcage.cli.demo:run", folder=tmp_path)
    assert "--requeue" not in off.script and "export CARDCAGE_REQUEUE_SIGNAL=none" in off.script
    (usr2,) = SlurmJob(requeue_signal="SIGUSR2", signal_delay_s=120).dry_run(
        "cardcage.cli.demo:run", folder=tmp_path
    )
    assert "#SBATCH --signal=USR2@120\n" in usr2.script
    assert "export CARDCAGE_REQUEUE_SIGNAL=USR2\n" in usr2.script


def test_extra_sbatch_options(tmp_path: Path) -> None:
    job = SlurmJob(gpus_per_node=2, sbatch={"account": "proj", "exclusive": True, "gres": "gpu:2"})
    (item,) = job.dry_run("cardcage.cli.demo:run", folder=tmp_path)
    assert "#SBATCH --account=proj\n" in item.script
    assert "#SBATCH --exclusive\n" in item.script
    assert "#SBATCH --gres=gpu:2\n" in item.script
    assert "--gpus-per-node" not in item.script  # gres asks for the GPUs instead


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"nodes": 0}, r"nodes=0 \(--nodes\) is not valid"),
        ({"gpus_per_node": -1}, r"gpus_per_node=-1 \(--gpus-per-node\) is not valid"),
        ({"job_name": "bash"}, r"job_name='bash' \(--job-name\) is the name of an interactive"),
        ({"job_name": "a b"}, r"job_name='a b' \(--job-name\) is not valid"),
        ({"time": "1h"}, r"time='1h' \(--time\) is not a SLURM time limit"),
        ({"time": 1}, r"signal_delay_s=90 \(--signal-delay-s\) is not below the time limit"),
        ({"trainer": {"num_nodes": 2}}, r"num_nodes=2 differs from nodes=1 \(--nodes\)"),
        ({"gpus_per_node": 4, "trainer": {"gpus": 2}}, r"gpus=2 differs from gpus_per_node=4"),
        ({"trainer": {"gpus": "0,1"}}, r"gpus='0,1' names GPU ids"),
        ({"trainer": {"gpus": -1}}, r"gpus=-1 \(all GPUs\) needs gpus_per_node"),
        ({"trainer": {"lr": 0.1}}, r"'lr' is not a Trainer flag"),
        ({"trainer": {"num_processes": 0}}, r"num_processes=0 is not valid"),
        ({"requeue_signal": "BOGUS"}, r"requeue_signal='BOGUS' is not a signal"),
        ({"requeue_signal": "none"}, r"requeue_signal='none' .* turns the signal off"),
        ({"sbatch": {"ntasks-per-node": 3}}, r"ntasks-per-node=3 \(--sbatch\) is set by cardcage"),
        ({"sbatch": {"Bad Option": 1}}, r"'Bad Option' \(--sbatch\) is not an sbatch option"),
        ({"master_port": 70000}, r"master_port=70000 \(--master-port\) is not a TCP port"),
        ({"mem": "lots"}, r"mem='lots' \(--mem\) is not an sbatch memory size"),
        ({"env": {"1A": "x"}}, r"env=.* \(--env\) is not valid"),
        ({"modules": [1]}, r"modules=\[1\] is not valid"),
        (
            {"nodes": 2, "gpus_per_node": 2, "trainer": {"distributed_backend": "dp"}},
            r"distributed_backend='dp' runs on one node, but num_nodes=2",
        ),
    ],
)
def test_misconfiguration(changes: dict[str, Any], expected: str) -> None:
    with pytest.raises(cardcage.MisconfigurationError, match=expected):
        SlurmJob(**changes).plan()


def test_target_errors(tmp_path: Path, function_file: Path) -> None:
    job = SlurmJob()
    with pytest.raises(cardcage.MisconfigurationError, match="neither a Python script"):
        job.dry_run("nothing-here", folder=tmp_path)
    with pytest.raises(cardcage.MisconfigurationError, match="cannot be imported here"):
        job.dry_run("no_such_module_xyz:train", folder=tmp_path)
    with pytest.raises(cardcage.MisconfigurationError, match="has no function 'nope'"):
        job.dry_run("cardcage.cli.demo:nope", folder=tmp_path)
    with pytest.raises(cardcage.MisconfigurationError, match="is not a file"):
        job.dry_run(f"{tmp_path}/missing.py:train", folder=tmp_path)
    with pytest.raises(cardcage.MisconfigurationError, match="both a grid hyperparameter"):
        job.dry_run(f"{function_file}:train", {"lr": [1]}, folder=tmp_path, kwargs={"lr": 2})
    with pytest.raises(cardcage.MisconfigurationError, match="cannot be passed to a script"):
        job.dry_run(function_file, folder=tmp_path, kwargs={"a": 1})
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / sub.MANIFEST).write_text("{}")
    with pytest.raises(cardcage.MisconfigurationError, match="already holds a submitted grid"):
        job.dry_run("cardcage.cli.demo:run", folder=tmp_path / "used")


def test_submit_without_srun_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(sub.SubmissionError, match="`srun` is not on PATH"):
        SlurmJob().submit("cardcage.cli.demo:run", folder=tmp_path / "grid")
    assert not (tmp_path / "grid").exists()


@pytest.mark.slow
def test_import_cardcage_does_not_import_submitit() -> None:
    # Loading the plugins imports cardcage_submit alone (not its modules);
    # cardcage.SlurmJob loads the submission modules on first use; submitit waits until a
    # job is planned
    code = (
        "import sys, cardcage\n"
        "def show(): print('submitit' in sys.modules, 'cardcage_submit' in sys.modules, "
        "'cardcage_submit.cli' in sys.modules, 'cardcage_submit.submission' in sys.modules)\n"
        "show(); cardcage.select(); show(); cardcage.SlurmJob; show()"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARDCAGE_")}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "False False False False",
        "False True False False",
        "False True False True",
    ]


# -- what a job runs ---------------------------------------------------------------------------


def _point(tmp_path: Path, target: str, **changes: Any) -> sub.GridPoint:
    plan = SlurmJob(trainer={"max_epochs": 2}).plan()
    _root, points = _points(
        plan,
        target,
        changes.pop("grid", {"lr": 0.1, "layers": 2}),
        tmp_path / "g",
        changes.pop("args", ()),
        changes.pop("kwargs", None),
    )
    point = points[0]
    Path(point.folder).mkdir(parents=True)
    (Path(point.folder) / sub.POINT_FILE).write_text(json.dumps(point.record(plan, "77")))
    return point


def test_run_point_calls_the_function_with_its_hyperparameters(
    tmp_path: Path, function_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(sub.RUN_VARIABLE, raising=False)
    point = _point(tmp_path, f"{function_file}:train", kwargs={"extra": 5})
    value = _run_point(point)
    assert value["lr"] == 0.1 and value["layers"] == 2 and value["extra"] == 5
    assert value["index"] == 0 and value["folder"] == point.folder
    assert value["flags"] == {"max_epochs": 2, "num_nodes": 1}
    record = json.loads((Path(point.folder) / sub.RESULT_FILE).read_text())
    assert record["hparams"] == {"lr": 0.1, "layers": 2} and record["result"] == value


def test_run_point_of_a_script(
    tmp_path: Path, function_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "argv"
    monkeypatch.setenv("CARDCAGE_TEST_OUT", str(out))
    assert _run_point(_point(tmp_path / "a", str(function_file), args=("0",))) is None
    assert out.read_text() == "0 --lr=0.1 --layers=2"
    with pytest.raises(RuntimeError, match="exited with status 3"):
        _run_point(_point(tmp_path / "b", str(function_file), args=("3",)))
    with pytest.raises(SystemExit) as requeued:  # a requeue leaves no result: it runs again
        _run_point(_point(tmp_path / "c", str(function_file), args=(str(REQUEUED_EXIT_STATUS),)))
    assert requeued.value.code == REQUEUED_EXIT_STATUS
    assert not (tmp_path / "c" / "g" / "000-lr=0.1-layers=2" / sub.RESULT_FILE).exists()


def test_run_point_takes_the_signals_back_from_submitit(
    tmp_path: Path, function_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handlers = {
        sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    }
    try:
        monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
        for sig in handlers:  # what submitit's process_job installs
            signal.signal(sig, lambda *_: None)
        _run_point(_point(tmp_path, f"{function_file}:train"))
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # scancel ends the task
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # cardcage's, at fit
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN  # submitit's, unused
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


# -- states from SLURM's commands --------------------------------------------------------------


def _fake_commands(folder: Path) -> None:
    folder.mkdir()
    commands = {
        "squeue": 'echo "101 RUNNING"; echo "102 PENDING"',
        "scontrol": 'case "$4" in 103) echo "JobId=103 JobState=COMPLETED Reason=None";; '
        '104) echo "JobId=104 JobState=CANCELLED";; *) exit 1;; esac',
        "sacct": "exit 1",
        "scancel": f'echo "$@" > {folder}/scancelled',
    }
    for name, body in commands.items():
        path = folder / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_states_results_and_cancel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from submitit.core.utils import cloudpickle_dump

    bin_ = tmp_path / "bin"
    _fake_commands(bin_)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    root = tmp_path / "grid"
    jobs = [
        sub.GridJob(index, {"lr": index}, root / f"{index:03d}", job_id)
        for index, job_id in enumerate(["101", "102", "103", "104", "105", None])
    ]
    for job in jobs:
        job.folder.mkdir(parents=True)
    cloudpickle_dump(("success", {"loss": 0.5}), jobs[2].folder / "103_0_result.pkl")
    cloudpickle_dump(("error", "Traceback: boom"), jobs[4].folder / "105_0_result.pkl")
    grid = Grid(root, jobs, {"accelerator": "cpu", "nodes": 1, "processes_per_node": 1})
    grid.save()
    loaded = Grid.load(root)
    assert [job.job_id for job in loaded.jobs] == ["101", "102", "103", "104", "105", None]
    states = loaded.states()
    assert states == ["RUNNING", "PENDING", "COMPLETED", "CANCELLED", "FAILED", "NOT_SUBMITTED"]
    assert not loaded.done()
    results = loaded.results(wait=False)
    assert results[2].ok and results[2].value == {"loss": 0.5}
    assert not results[4].ok and "boom" in str(results[4].error)
    assert "CANCELLED and left no result" in str(results[3].error)
    assert loaded.cancel() == ["101", "102"]
    assert (bin_ / "scancelled").read_text().split() == ["101", "102"]


# -- the command line --------------------------------------------------------------------------


def cardcage_command(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """``cardcage ARGV`` as a user runs it (``python -m cardcage``), in this process's
    environment (the fixtures' variables and PATH included): its status, stdout and stderr."""
    return subprocess.run(
        [sys.executable, "-m", "cardcage", *argv], capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_cli_dry_run_prints_each_script(tmp_path: Path, function_file: Path) -> None:
    done = cardcage_command(
        [
            "submit",
            str(function_file),
            "--nodes",
            "2",
            "--num-processes",
            "2",
            "--grid",
            "lr=1e-3,1e-2",
            "--grid",
            "layers=16,32",
            "--time",
            "30",
            "--folder",
            str(tmp_path / "g"),
            "--dry-run",
            "--",
            "--epochs",
            "3",
        ]
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("# cardcage submit --dry-run: 4 job(s), ddp on 2 node(s) x 2 process(es)")
    assert out.count("#!/bin/bash\n") == 4
    assert out.count("#SBATCH --ntasks-per-node=2\n") == 4
    assert "# ---- job 4 of 4: lr=0.01 layers=32" in out
    assert not (tmp_path / "g").exists()


@pytest.mark.slow
def test_cli_options_before_and_after_the_target(tmp_path: Path) -> None:
    done = cardcage_command(
        [
            "submit",
            "--nodes",
            "2",
            "cardcage.cli.demo:run",
            "--grid",
            "a=1",
            "--dry-run",
            "--json",
            "--folder",
            str(tmp_path),
        ]
    )
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["plan"]["nodes"] == 2
    assert [job["hparams"] for job in document["jobs"]] == [{"a": 1}]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["submit", "cardcage.cli.demo:run", "--grid", "lr", "--dry-run"],
            "--grid 'lr' is not NAME=VALUES",
        ),
        (
            ["submit", "cardcage.cli.demo:run", "--grid", "a=1", "--grid", "a=2", "--dry-run"],
            "repeats 'a'",
        ),
        (
            ["submit", "cardcage.cli.demo:run", "--nodes", "2", "--num-nodes", "3", "--dry-run"],
            "num_nodes=3 differs",
        ),
        (["submit", "cardcage.cli.demo:run", "--time", "1h", "--dry-run"], "time='1h' (--time)"),
        (
            ["submit", "cardcage.cli.demo:run", "--env", "X", "--dry-run"],
            "--env 'X' is not NAME=VALUE",
        ),
        (["submit", "cardcage.cli.demo:run", "--dry-run", "--", "--epochs", "3"], "go to a script"),
        (["submit", "nothing-here", "--dry-run"], "neither a Python script"),
        (["jobs", "/nonexistent/grid"], "holds no submitted grid"),
    ],
)
@pytest.mark.slow
def test_cli_errors_exit_2_with_one_line(argv: list[str], expected: str) -> None:
    done = cardcage_command(argv)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.startswith("cardcage: error: ") and expected in done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


@pytest.mark.slow
def test_cli_jobs_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_ = tmp_path / "bin"
    _fake_commands(bin_)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    root = tmp_path / "grid"
    job = sub.GridJob(0, {"lr": 0.1, "layers": 16}, root / "000", "101")
    job.folder.mkdir(parents=True)
    (job.folder / sub.RESULT_FILE).write_text(json.dumps({"result": {"loss": 0.25}}))
    Grid(root, [job], {"accelerator": "ddp", "nodes": 2, "processes_per_node": 4}).save()
    done = cardcage_command(["jobs", str(root)])
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert out[0] == f"grid {root}: 1 job(s), ddp on 2 node(s) x 4 process(es)"
    assert out[2].split() == ["0", "101", "RUNNING", "lr=0.1", "layers=16", '{"loss":', "0.25}"]
    done = cardcage_command(["jobs", str(root), "--cancel", "--json"])
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["cancelled"] == ["101"]
