"""The ``cardcage`` command, run as ``python -m cardcage`` in a fresh process.

Each run imports torch (seconds), so the commands several tests read are run once per module.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from cardcage import Accelerator, Availability
from cardcage.cli import main as cli
from cardcage.plugins import manager as plugins

pytestmark = pytest.mark.slow

# backend -> distribution, for the nine that ship with cardcage (the core session installs all)
SHIPPED = {
    "cpu": "cardcage-cpu",
    "gpu": "cardcage-gpu",
    "dp": "cardcage-dp",
    "ddp": "cardcage-ddp",
    "ddp2": "cardcage-ddp2",
    "ddp_spawn": "cardcage-spawn",
    "horovod": "cardcage-horovod",
    "tpu": "cardcage-tpu",
    "fsdp": "cardcage-fsdp",
}
STEERING_PREFIXES = ("CARDCAGE_", "PL_TRAINER_", "SLURM_", "TORCHELASTIC_", "OMPI_", "HOROVOD_")
STEERING_NAMES = ("WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "MASTER_ADDR")
STEERING_NAMES += ("MASTER_PORT", "PJRT_DEVICE", "LOCAL_WORLD_SIZE")


def cardcage(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m cardcage ARGS`` with no cluster or plugin variables but ``env``."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(STEERING_PREFIXES) and k not in STEERING_NAMES
    }
    return subprocess.run(
        [sys.executable, "-m", "cardcage", *args],
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


def refused(result: subprocess.CompletedProcess[str]) -> str:
    """A bad configuration: status 2, the message on stderr, nothing on stdout, no traceback."""
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("cardcage: error: ")
    return result.stderr


@pytest.fixture(scope="module")
def plugins_text() -> str:
    return ok(cardcage("plugins"))


@pytest.fixture(scope="module")
def plugins_json() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(ok(cardcage("plugins", "--json")))
    return document


def test_plugins_lists_the_eight_backends_with_their_distributions(plugins_text: str) -> None:
    lines = plugins_text.splitlines()
    assert lines[0] == "backends:"
    for backend, distribution in SHIPPED.items():
        (line,) = [ln for ln in lines if ln.strip().startswith(f"{backend} ")]
        assert f"[{distribution} " in line, line
        assert "available" in line
    (spawn,) = [ln for ln in lines if ln.strip().startswith("ddp_spawn ")]
    assert "aliases: spawn, ddp_cpu" in spawn


@pytest.mark.skipif(importlib.util.find_spec("horovod") is not None, reason="horovod installed")
def test_plugins_says_why_horovod_cannot_run_and_how_to_install_it(plugins_text: str) -> None:
    (line,) = [ln for ln in plugins_text.splitlines() if ln.strip().startswith("horovod ")]
    assert "unavailable: horovod is not installed" in line
    assert "python -m cardcage_horovod.build --install" in line


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="torch-xla installed")
def test_plugins_says_why_tpu_cannot_run_and_how_to_install_it(plugins_text: str) -> None:
    (line,) = [ln for ln in plugins_text.splitlines() if ln.strip().startswith("tpu ")]
    assert "unavailable: torch_xla is not installed" in line
    assert "pip install torch==2.9.0 torch-xla==2.9.0" in line


def test_plugins_json_is_one_document(plugins_json: dict[str, Any]) -> None:
    backends = {row["name"]: row for row in plugins_json["backends"]}
    assert set(SHIPPED) <= set(backends)
    for backend, distribution in SHIPPED.items():
        assert backends[backend]["distribution"] == distribution
        assert isinstance(backends[backend]["available"], bool)
    assert backends["cpu"]["available"] is True
    assert backends["cpu"]["rules"] == [
        {"order": 1000, "name": "cpu_fallback", "why": "the CPU is always there"}
    ]
    statuses = {record["name"]: record["status"] for record in plugins_json["plugins"]}
    assert statuses["cpu"] == "loaded"


def test_explain_json_is_one_document() -> None:
    result = cardcage("explain", "--num-processes", "2", "--json")
    selection = json.loads(ok(result))
    assert (selection["accelerator"], selection["rule"], selection["world_size"]) == (
        "ddp_spawn",
        "cpu_processes",
        2,
    )
    assert [entry["order"] for entry in selection["trace"]] == sorted(
        entry["order"] for entry in selection["trace"]
    )


def test_explain_text_names_the_decision_and_every_rule() -> None:
    out = ok(cardcage("explain", "--num-nodes", "2"))
    assert out.startswith("selected 'ddp' by multi_node_or_cluster")
    for rule in ("horovodrun", "tpu_cores", "multi_gpu", "cpu_processes", "single_gpu"):
        assert rule in out


def test_explain_accepts_the_backend_alias_flag() -> None:
    selection = json.loads(
        ok(cardcage("explain", "--backend", "ddp_cpu", "--num-processes", "3", "--json"))
    )
    assert (selection["accelerator"], selection["requested"], selection["num_processes"]) == (
        "ddp_spawn",
        "ddp_spawn",
        3,
    )


def test_explain_unknown_backend_exits_2_with_a_did_you_mean() -> None:
    message = refused(cardcage("explain", "--distributed-backend", "dpp"))
    assert "distributed_backend='dpp'" in message
    assert "Did you mean 'dp'?" in message


def test_explain_num_nodes_0_exits_2() -> None:
    assert "num_nodes=0" in refused(cardcage("explain", "--num-nodes", "0", "--json"))


def test_explain_gpus_this_machine_lacks_exits_2() -> None:
    assert "gpus='99,'" in refused(cardcage("explain", "--gpus", "99,"))


def test_a_bad_plugin_setting_exits_2() -> None:
    message = refused(cardcage("plugins", env={"CARDCAGE_PLUGINS_AUTOLOAD": "maybe"}))
    assert "CARDCAGE_PLUGINS_AUTOLOAD='maybe'" in message


def test_a_disabled_plugin_is_listed_as_disabled() -> None:
    out = ok(cardcage("plugins", env={"CARDCAGE_DISABLE_PLUGINS": "ddp2"}))
    backends, _, others = out.partition("plugins not loaded:")
    assert "ddp2 " not in backends
    assert "ddp2 [cardcage-ddp2 " in others and "disabled" in others


def test_env_reports_versions_and_the_local_cluster() -> None:
    out = ok(cardcage("env"))
    assert f"python: {sys.version.split()[0]}" in out
    assert f"torch: {torch.__version__}" in out
    assert "cardcage-core: " in out
    assert "detected: local" in out


def test_env_detects_a_one_task_slurm_job() -> None:
    # `cardcage env` has no flags, so it asks about a one-process job.
    env = {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_NODELIST": "node[001-004]"}
    out = ok(cardcage("env", env=env))
    assert "detected: slurm" in out
    assert "SLURM_NODELIST: node[001-004]" in out


def test_env_json_explains_a_slurm_job_it_does_not_manage() -> None:
    env = {"SLURM_NTASKS": "4", "SLURM_JOB_NAME": "train"}
    report = json.loads(ok(cardcage("env", "--json", env=env)))
    cluster = report["cluster environment"]
    assert cluster["detected"] == "local"
    assert cluster["SLURM_NTASKS"] == "4"
    assert "SLURM_NTASKS=4 differs" in cluster["note 1"]
    assert report["versions"]["torch"] == torch.__version__


def test_a_reader_that_leaves_early_gets_no_traceback() -> None:
    # `cardcage explain | head -1`: the pipe closes before everything is written
    process = subprocess.Popen(
        [sys.executable, "-m", "cardcage", "explain"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr


# -- a plugin whose availability check takes long -----------------------------------------------

SLEEPY_MODULE = """
import time

import cardcage


class Sleepy(cardcage.Accelerator):
    name = "sleepy"
    rules = ()

    @classmethod
    def availability(cls, ctx):
        time.sleep(float(ctx.env["SLEEPY_SECONDS"]))
        return cardcage.Availability(True, "woke up")


@cardcage.hookimpl
def cardcage_accelerators():
    return [Sleepy]
"""


def installed_sleepy(site: Path) -> Path:
    """A plugin distribution installed into ``site`` as ``pip install --target`` lays it out
    (the module and its dist-info with the entry point), for ``PYTHONPATH``."""
    site.mkdir()
    (site / "cardcage_sleepy.py").write_text(SLEEPY_MODULE)
    info = site / "cardcage_sleepy-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: cardcage-sleepy\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[cardcage]\nsleepy = cardcage_sleepy\n")
    return site


SLEEPY_CHECK = "plugin sleepy's availability check of backend 'sleepy'"


def _run_beside_a_slow_check(tmp_path: Path, *arguments: str) -> tuple[str, bool, str, str, int]:
    """``python ARGUMENTS`` with an installed plugin whose check takes longer than
    SLOW_CHECK_S: stderr's first line, whether the process still ran when it came, the rest
    of stdout and stderr, and the exit status."""
    site = installed_sleepy(tmp_path / "site")
    seconds = plugins.SLOW_CHECK_S + 1.5
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(STEERING_PREFIXES) and k not in STEERING_NAMES
    }
    env = {**clean, "PYTHONPATH": str(site), "SLEEPY_SECONDS": str(seconds)}
    process = subprocess.Popen(
        [sys.executable, *arguments],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    try:
        first = process.stderr.readline()
        still_running = process.poll() is None
        stdout, rest = process.communicate(timeout=120)
    finally:
        process.kill()
        process.wait()
    return first, still_running, stdout, rest, process.returncode


def test_a_slow_availability_check_is_named_while_it_runs_and_timed(tmp_path: Path) -> None:
    """``cardcage plugins`` with an installed plugin whose check takes longer than
    SLOW_CHECK_S: stderr names the check while it still runs (the command is not silent),
    and the listing shows how long it took."""
    first, still_running, stdout, rest, code = _run_beside_a_slow_check(
        tmp_path, "-m", "cardcage", "plugins"
    )
    assert first == f"cardcage: waiting for {SLEEPY_CHECK} (5 s so far)\n", first + rest
    assert still_running  # named while it ran, not afterwards
    assert f"cardcage: {SLEEPY_CHECK} returned after 6." in rest, rest
    (line,) = [ln for ln in stdout.splitlines() if ln.strip().startswith("sleepy ")]
    assert "[cardcage-sleepy 0.1.0]  available: woke up  (availability check: 6." in line, line
    assert code == 0


@pytest.mark.parametrize(
    "command",
    [
        ["-m", "cardcage", "explain", "--distributed-backend", "sleepy"],
        ["-c", "import cardcage; cardcage.Trainer(distributed_backend='sleepy')"],
    ],
    ids=["cardcage explain", "Trainer()"],
)
def test_a_slow_availability_check_is_named_while_selection_waits_for_it(
    tmp_path: Path, command: list[str]
) -> None:
    """``cardcage explain`` and the Trainer constructor wait for the same installed plugin's
    slow check: stderr names it while it still runs, and says when it returned; the command
    goes on to succeed."""
    first, still_running, _, rest, code = _run_beside_a_slow_check(tmp_path, *command)
    assert first == f"cardcage: waiting for {SLEEPY_CHECK} (5 s so far)\n", first + rest
    assert still_running  # named while it ran, not afterwards
    assert f"cardcage: {SLEEPY_CHECK} returned after 6." in rest, rest
    assert code == 0, rest


def test_every_check_is_timed_and_a_quick_one_is_not_named(
    inprocess_accelerators: Callable[..., None],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """In process: a check is named again every SLOW_CHECK_S seconds while it runs; a quick
    check prints nothing; ``--json`` has every backend's check time."""

    class Slow(Accelerator):
        name = "slow"
        rules = ()

        @classmethod
        def availability(cls, ctx: Any) -> Availability:
            time.sleep(0.75)
            return Availability(False, "not today")

    class Quick(Accelerator):
        name = "quick"
        rules = ()

        @classmethod
        def availability(cls, ctx: Any) -> Availability:
            return Availability(True, "at once")

    inprocess_accelerators("slow", Slow, Quick)
    monkeypatch.setattr(plugins, "SLOW_CHECK_S", 0.2)
    assert cli.main(["plugins", "--json"]) == 0
    captured = capsys.readouterr()
    rows = {row["name"]: row for row in json.loads(captured.out)["backends"]}
    assert rows["slow"]["check_seconds"] >= 0.75
    assert rows["quick"]["check_seconds"] < 0.2
    waiting = [ln for ln in captured.err.splitlines() if "waiting for" in ln and "'slow'" in ln]
    assert len(waiting) >= 3, captured.err
    assert "backend 'quick'" not in captured.err
