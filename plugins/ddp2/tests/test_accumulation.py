"""Gradient accumulation on ddp2 averages across nodes once per optimizer step: backward
skips its all-reduce inside ``skip_gradient_sync``. The kit's ``accumulate`` scenario checks
the weights, which an average per micro-batch would leave right too; this checks that the
gradients are still each node's own until the last micro-batch."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

from cardcage.testing.harness import Harness

JOB = Path(__file__).with_name("accumulation_job.py")


def test_micro_batches_before_the_last_keep_each_nodes_own_gradients(tmp_path: Path) -> None:
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
    for rank in range(2):
        lines = (out / f"rank{rank}.jsonl").read_text().splitlines()
        averaged = [json.loads(line) for line in lines]
        # 8 batches per node and epoch in steps of 3, 3 and 2: 5 later micro-batches, 2 epochs
        assert len(averaged) == 10, averaged
        assert not any(averaged), (
            f"rank {rank}: a micro-batch before the last of its step found gradients already "
            f"averaged over the nodes ({averaged}): they were all-reduced early"
        )
