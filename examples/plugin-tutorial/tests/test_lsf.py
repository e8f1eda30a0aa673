"""Tests of cardcage-lsf. They pass with only cardcage-core and this plugin installed, and in
a full install: every selection loads this plugin alone (``ALONE``). A fake jsrun job is a
handful of environment variables and a rank file."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from cardcage import MisconfigurationError, sdk, select

ALONE = {"CARDCAGE_PLUGINS_AUTOLOAD": "0", "CARDCAGE_PLUGINS": "lsf"}
HOSTS = ("node07", "node08")


@pytest.fixture
def jsrun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Rank 3 of 4, on the second of two hosts, two ranks per host."""
    rankfile = tmp_path / "rankfile"
    rankfile.write_text("launch01\n" + "".join(f"{host}\n" * 2 for host in HOSTS))
    monkeypatch.setattr(socket, "gethostname", lambda: "node08.cluster.example")
    return {
        **ALONE,
        "LSB_JOBID": "4242",
        "LSB_DJOB_RANKFILE": str(rankfile),
        "JSM_NAMESPACE_SIZE": "4",
        "JSM_NAMESPACE_RANK": "3",
        "JSM_NAMESPACE_LOCAL_RANK": "1",
    }


def test_it_registers_a_backend_and_a_cluster_environment() -> None:
    registry = sdk.registry(ALONE)
    found = registry.accelerators["lsf"]
    assert (found.plugin, found.distribution) == ("lsf", "cardcage-lsf")
    assert registry.canonical("jsrun") == "lsf"
    assert "lsf" in [environment.name for environment in registry.environments]


def test_its_rule_claims_a_job_jsrun_started(jsrun: dict[str, str]) -> None:
    selection = select(env=jsrun)
    assert (selection.accelerator, selection.rule, selection.cluster) == ("lsf", "jsrun", "lsf")
    assert (selection.world_size, selection.num_processes) == (4, 2)
    assert (selection.global_rank, selection.local_rank, selection.node_rank) == (3, 1, 1)
    # rank 0 is on the first compute host; the port comes from the job id
    assert (selection.master_address, selection.master_port) == ("node07", 10242)


def test_a_master_address_and_port_already_set_win(jsrun: dict[str, str]) -> None:
    selection = select(env={**jsrun, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500"})
    assert (selection.master_address, selection.master_port) == ("10.0.0.7", 29500)


def test_outside_jsrun_its_rule_claims_nothing() -> None:
    with pytest.raises(MisconfigurationError, match="no installed backend claims this job"):
        select(env=ALONE)


def test_named_outside_jsrun_it_says_how_to_launch() -> None:
    with pytest.raises(MisconfigurationError, match=r"'jsrun' selects 'lsf', which is not"):
        select(env=ALONE, distributed_backend="jsrun")
    with pytest.raises(MisconfigurationError, match=r"launch the script with jsrun"):
        select(env=ALONE, distributed_backend="lsf")


def test_a_host_outside_the_job_is_refused(
    jsrun: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "login01")
    with pytest.raises(MisconfigurationError, match=r"'login01', is not among the compute"):
        select(env=jsrun)


def test_a_missing_rank_file_is_refused(jsrun: dict[str, str]) -> None:
    with pytest.raises(MisconfigurationError, match=r"LSB_DJOB_RANKFILE is not set"):
        select(env={k: v for k, v in jsrun.items() if k != "LSB_DJOB_RANKFILE"})
