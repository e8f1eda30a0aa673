"""cardcage-fsdp against the conformance kit: two processes by script relaunch, two started
by torchrun, two spawned (``fsdp_spawn``), and two nodes of one spawned process each (every
node's caller gets the full trained state, which FSDP gathers on rank 0 alone)."""

from __future__ import annotations

from cardcage.testing import BackendSuite, Launch


def processes(count: int, **env: str) -> Launch:
    flags = {"distributed_backend": "fsdp", "num_processes": count}
    return Launch(flags, world_size=count, env=env)


class TestFSDP(BackendSuite):
    backend = "fsdp"
    batch_size = 8  # per process: two of them reproduce one process of 16
    launches = {
        "relaunch": processes(2),
        "torchrun": Launch({"distributed_backend": "fsdp"}, world_size=2, command="torchrun"),
        "spawn": Launch({"distributed_backend": "fsdp_spawn", "num_processes": 2}, world_size=2),
        "spawn_two_nodes": Launch(
            {"distributed_backend": "fsdp_spawn", "num_processes": 1, "num_nodes": 2},
            world_size=2,
            command="nodes",
        ),
    }
    sharded_optimizer_state = True  # each rank holds its shard of Adam's and SGD's state
    # A full checkpoint (one file) and a sharded one (a folder) are resharded for the ranks
    # that resume them, whatever their number.
    resume_world_sizes = {
        "full_2_to_3": (processes(2), processes(3)),
        "sharded_3_to_2": (
            processes(3, CARDCAGE_FSDP_STATE_DICT="sharded"),
            processes(2, CARDCAGE_FSDP_STATE_DICT="sharded"),
        ),
    }
