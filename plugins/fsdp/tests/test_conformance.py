"""cardcage-fsdp against the conformance kit: two processes by script relaunch, two started
by torchrun, and two spawned (``fsdp_spawn``)."""

from __future__ import annotations

from cardcage.testing import BackendSuite, Launch


class TestFSDP(BackendSuite):
    backend = "fsdp"
    batch_size = 8  # per process: two of them reproduce one process of 16
    launches = {
        "relaunch": Launch({"distributed_backend": "fsdp", "num_processes": 2}, world_size=2),
        "torchrun": Launch({"distributed_backend": "fsdp"}, world_size=2, command="torchrun"),
        "spawn": Launch({"distributed_backend": "fsdp_spawn", "num_processes": 2}, world_size=2),
    }
