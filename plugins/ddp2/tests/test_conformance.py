"""cardcage-ddp2 against the conformance kit: two nodes of one CPU process each (with no GPU
ddp2 trains one process per node), started by hand on this machine."""

from __future__ import annotations

from cardcage.testing import BackendSuite, Launch


class TestDDP2(BackendSuite):
    backend = "ddp2"
    launches = {
        "two_nodes": Launch(
            {"distributed_backend": "ddp2", "num_nodes": 2}, world_size=2, command="nodes"
        )
    }
