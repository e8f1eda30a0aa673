"""cardcage-tpu against the conformance kit, on torch-xla's CPU device: one core in this
process, and every core (two XLA CPU devices, replicas from xmp.spawn)."""

from __future__ import annotations

import importlib.util

import pytest

from cardcage.testing import BackendSuite, Launch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch_xla") is None,
    reason="torch-xla is not installed (nox -s tpu installs it)",
)
XLA_CPU = {"PJRT_DEVICE": "CPU"}


class TestTPU(BackendSuite):
    backend = "tpu"
    launches = {
        "one_core": Launch({"tpu_cores": 1}, env=XLA_CPU),
        "every_core": Launch(
            {"tpu_cores": 8}, world_size=2, env={**XLA_CPU, "CPU_NUM_DEVICES": "2"}
        ),
    }
