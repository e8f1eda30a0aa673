"""A subprocess a rank starts (from a callback) is not a rank of the job.

It inherits the rank's RANK, WORLD_SIZE, MASTER_ADDR/MASTER_PORT and LOCAL_RANK; read as
its own, a ``cardcage.select()`` there chose "ddp, world 2" and a fit dialled the live
store. Each rank exports ``CARDCAGE_RANK_PID`` (its pid), and a process whose
``CARDCAGE_RANK_PID`` names another pid selects as a plain local process
(:mod:`cardcage.environments.inherited`). Real 2-process fits: ``ddp_spawn`` (spawned
workers) and ``ddp`` (the script run again; rank 0 is the caller).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from .conftest import PYTHON, SCRIPTS

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("backend", ["ddp_spawn", "ddp"])
def test_a_child_of_a_rank_selects_a_plain_local_process(harness: Any, backend: str) -> None:
    out = harness.root / "out"
    harness.start([PYTHON, str(SCRIPTS / "child_of_rank.py"), str(out), backend]).check()
    harness.assert_no_leftovers()
    for rank in (0, 1):
        got = json.loads((out / f"rank-{rank}.json").read_text())
        # the ranks themselves are still ranks of a job of two
        assert got["world_size"] == 2, got
        assert got["rank_variables"] == {"RANK": str(rank), "WORLD_SIZE": "2"}, got
        assert got["child_status"] == 0, got["child_stderr"]
        assert got["child"] == "cpu 1", got
