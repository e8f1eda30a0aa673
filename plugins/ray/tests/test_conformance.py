"""cardcage-ray against the conformance kit, on the session's two-node Ray cluster (one actor
per node): ``ray`` and ``ray_fsdp``. A local Ray that the job starts and stops itself is
proven in test_ray.py (training, and no process left): its start, about 3 s, would be paid
by every fit of the kit's jobs."""

from __future__ import annotations

from cardcage.testing import BackendSuite, Launch


class TestRay(BackendSuite):
    backend = "ray"
    batch_size = 8  # per process: two of them reproduce one process of 16
    launches = {
        "two_nodes": Launch({"distributed_backend": "ray", "num_nodes": 2}, world_size=2),
    }


class TestRayFSDP(BackendSuite):
    backend = "ray_fsdp"
    plugin = "ray"
    batch_size = 8
    launches = {
        "two_nodes": Launch({"distributed_backend": "ray_fsdp", "num_nodes": 2}, world_size=2),
    }
    sharded_optimizer_state = True
