"""cardcage-ray against the conformance kit: ``ray`` on the session's two-node Ray cluster
(one actor per node) and on a local Ray the job starts and stops itself; ``ray_fsdp`` on the
two-node cluster."""

from __future__ import annotations

from cardcage.testing import BackendSuite, Launch

#: A job that finds no RAY_ADDRESS starts a local Ray of its own.
LOCAL = {"RAY_ADDRESS": ""}


class TestRay(BackendSuite):
    backend = "ray"
    batch_size = 8  # per process: two of them reproduce one process of 16
    launches = {
        "two_nodes": Launch({"distributed_backend": "ray", "num_nodes": 2}, world_size=2),
        "local": Launch(
            {"distributed_backend": "ray", "num_processes": 2}, world_size=2, env=LOCAL
        ),
    }


class TestRayFSDP(BackendSuite):
    backend = "ray_fsdp"
    plugin = "ray"
    batch_size = 8
    launches = {
        "two_nodes": Launch({"distributed_backend": "ray_fsdp", "num_nodes": 2}, world_size=2),
    }
    sharded_optimizer_state = True
