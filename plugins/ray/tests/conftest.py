"""A two-node Ray cluster on this machine, for the whole test session.

Two Ray nodes (one CPU each) of ``ray.cluster_utils.Cluster``, on loopback: a job that asks
for ``num_nodes=2`` gets one actor on each. ``RAY_ADDRESS`` names it for the session, so the
kit's jobs and the tests' scripts join it; a launch that sets ``RAY_ADDRESS=""`` starts a
local Ray of its own instead.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def ray_cluster() -> Iterator[str]:
    """The cluster's address, in ``RAY_ADDRESS`` while the session runs."""
    # Before any import of ray: its nodes listen on loopback, not on the outward address.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from ray.cluster_utils import Cluster

    # Ray's Unix sockets live under RAY_TMPDIR: a short path keeps them under the limit.
    folder = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    before = {name: os.environ.get(name) for name in ("RAY_TMPDIR", "RAY_ADDRESS")}
    os.environ["RAY_TMPDIR"] = folder
    node = {"num_cpus": 1, "object_store_memory": 100 << 20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        cluster.add_node(**node)
        cluster.wait_for_nodes()
        os.environ["RAY_ADDRESS"] = cluster.address
        yield str(cluster.address)
    finally:
        cluster.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
