"""cardcage-ddp against the conformance kit: two processes by script relaunch, and two
started by torchrun."""

from __future__ import annotations

from cardcage.testing import BackendSuite, Launch


class TestDDP(BackendSuite):
    backend = "ddp"
    launches = {
        "relaunch": Launch({"distributed_backend": "ddp", "num_processes": 2}, world_size=2),
        "torchrun": Launch({"distributed_backend": "ddp"}, world_size=2, command="torchrun"),
    }
