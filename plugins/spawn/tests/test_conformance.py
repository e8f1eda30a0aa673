"""cardcage-spawn against the conformance kit: two workers from torch.multiprocessing."""

from __future__ import annotations

from cardcage.testing import BackendSuite, Launch


class TestDDPSpawn(BackendSuite):
    backend = "ddp_spawn"
    plugin = "spawn"
    launches = {
        "spawn": Launch({"distributed_backend": "ddp_spawn", "num_processes": 2}, world_size=2)
    }
