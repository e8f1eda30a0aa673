"""cardcage-horovod against the conformance kit, on a real Horovod build: two workers it
starts itself through Horovod's Gloo runner, and two started by horovodrun.

The kit compares against a plain loop at the combined batch, so the learning rate is not
multiplied by the number of processes here (CARDCAGE_HOROVOD_SCALE_LR=0).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from cardcage.testing import BackendSuite, Launch

KEEP_LR = {"CARDCAGE_HOROVOD_SCALE_LR": "0"}


@pytest.fixture(scope="module", autouse=True)
def horovod_installed() -> None:
    """Without Horovod the checks skip with the reason; under CI (``CI`` set) they fail with
    it, since the horovod session exists to run them. Module scope: before the kit's jobs."""
    if importlib.util.find_spec("horovod") is None:
        reason = "Horovod is not installed (nox -s horovod builds it)"
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(f"under CI: {reason}", pytrace=False)
        pytest.skip(reason)


class TestHorovod(BackendSuite):
    backend = "horovod"
    launches = {
        "gloo_runner": Launch(
            {"distributed_backend": "horovod", "num_processes": 2}, world_size=2, env=KEEP_LR
        ),
        "horovodrun": Launch({}, world_size=2, command="horovodrun", env=KEEP_LR),
    }
