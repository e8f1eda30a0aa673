"""cardcage.environments.inherited: rank variables a child of a rank inherited are not its
own, and selection reads its environment without them."""

from __future__ import annotations

import os

import pytest

import cardcage
from cardcage.environments import inherited

#: What a child of rank 1 of a two-process ddp_spawn job inherits.
RANK_ONE = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "NODE_RANK": "0",
    "GROUP_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29512",
    "TORCHELASTIC_RUN_ID": "job",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "CARDCAGE_HOSTED_STORE": "1",
    "CARDCAGE_HEARTBEAT": "/tmp/nowhere",
    "CARDCAGE_ERROR_FILE": "/tmp/nowhere/rank-1.txt",
    "HOME": "/home/someone",
}
OTHER_PID = os.getpid() + 1


def test_unset_or_own_pid_is_not_inherited() -> None:
    assert not inherited.is_inherited(RANK_ONE)
    assert not inherited.is_inherited({**RANK_ONE, inherited.RANK_PID: ""})
    assert not inherited.is_inherited({**RANK_ONE, inherited.RANK_PID: str(os.getpid())})
    assert inherited.is_inherited({inherited.RANK_PID: "7"}, pid=8)
    assert not inherited.is_inherited({inherited.RANK_PID: " 8 "}, pid=8)


def test_another_pid_is_inherited_and_its_rank_variables_are_dropped() -> None:
    env = {**RANK_ONE, inherited.RANK_PID: str(OTHER_PID), "OMPI_COMM_WORLD_RANK": "1"}
    assert inherited.is_inherited(env)
    assert inherited.effective(env) == {"HOME": "/home/someone"}


def test_own_variables_are_read_as_they_are() -> None:
    env = {**RANK_ONE, inherited.RANK_PID: str(os.getpid())}
    assert inherited.effective(env) is env


def test_a_pid_that_is_not_a_number_is_named() -> None:
    with pytest.raises(cardcage.MisconfigurationError, match="CARDCAGE_RANK_PID='x1'"):
        inherited.is_inherited({inherited.RANK_PID: "x1"})


def test_mark_and_for_child() -> None:
    env: dict[str, str] = {}
    inherited.mark(env)
    assert env == {inherited.RANK_PID: str(os.getpid())}
    inherited.mark(env, pid=12)
    assert env[inherited.RANK_PID] == "12"
    assert inherited.for_child({**RANK_ONE, inherited.RANK_PID: "12"}) == RANK_ONE


def test_selection_ignores_inherited_rank_variables() -> None:
    own = cardcage.select(env={**RANK_ONE, inherited.RANK_PID: str(os.getpid())})
    assert (own.accelerator, own.cluster, own.world_size, own.global_rank) == (
        "ddp",
        "torchelastic",
        2,
        1,
    )
    child = cardcage.select(env={**RANK_ONE, inherited.RANK_PID: str(OTHER_PID)})
    assert (child.accelerator, child.cluster, child.world_size, child.global_rank) == (
        "cpu",
        "local",
        1,
        0,
    )
    assert child.master_port is None  # it would host its own store, not dial the rank's
