"""cardcage-ddp against the conformance kit: two processes by script relaunch, and two
started by torchrun."""

from __future__ import annotations

from cardcage.testing import BackendSuite, Launch


def processes(count: int) -> Launch:
    return Launch({"distributed_backend": "ddp", "num_processes": count}, world_size=count)


class TestDDP(BackendSuite):
    backend = "ddp"
    launches = {
        "relaunch": processes(2),
        "torchrun": Launch({"distributed_backend": "ddp"}, world_size=2, command="torchrun"),
    }
    # Every rank holds the whole model and optimizer state, so any number of them resumes it.
    resume_world_sizes = {"2_to_3": (processes(2), processes(3))}
