"""A user's own loop on ddp2 through ``cardcage.Cage`` (own_loop_job.py): two nodes of one CPU
process each, started by hand on this machine. Proven: 2 processes of batch 8 train like one
of batch 16 with momentum SGD (each rank builds its model from a seed of its own; setup gives
every rank rank 0's weights), ``no_backward_sync`` leaves each node's gradients its own
until the next backward outside it averages the sums, two modules set up one after the
other each with its optimizer train together (backward averages the gradients of every
module set up), and both nodes' ``launch`` returns rank 0's value."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from cardcage.testing.harness import Harness

JOB = Path(__file__).with_name("own_loop_job.py")


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp_path = tmp_path_factory.mktemp("own_loop")
    harness = Harness(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    meet = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    try:
        runs = [
            harness.start(
                [sys.executable, str(JOB), str(out)],
                harness.env(**meet, NODE_RANK=str(node)),
                f"node {node}",
            )
            for node in range(2)
        ]
        for run in runs:
            run.check()
        harness.assert_no_leftovers()
    finally:
        harness.cleanup()
    return {
        "returned": [json.loads((out / f"returned{r}.json").read_text()) for r in range(2)],
        "plain": json.loads((out / "plain.json").read_text()),
        "ranks": [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)],
    }


@pytest.mark.parametrize("scenario", ["parity", "accumulate", "two"])
def test_two_nodes_of_batch_8_train_like_one_process_of_batch_16(
    job: dict[str, Any], scenario: str
) -> None:
    want = job["plain"][scenario]
    for node, returned in enumerate(job["returned"]):
        pairs = zip(returned[scenario], want, strict=True)
        difference = max(abs(a - b) for g, w in pairs for a, b in zip(g, w, strict=True))
        assert difference < 1e-5, f"{scenario}, node {node}: weights differ by {difference}"


def test_no_backward_sync_averages_only_at_the_next_backward_outside(
    job: dict[str, Any],
) -> None:
    for rank, seen in enumerate(job["ranks"]):
        assert seen["world_size"] == 2
        # after each micro-batch: inside no_backward_sync (own gradients), then outside
        assert seen["averaged"] == [False, True] * 8, (
            f"rank {rank}: gradients averaged over the nodes after each backward: "
            f"{seen['averaged']} (an early average shows as True at an even position)"
        )
