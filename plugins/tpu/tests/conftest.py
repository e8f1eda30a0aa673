"""Where torch_xla is installed, start XLA's CPU device before any test runs a backward pass.

PyTorch's autograd engine sizes its per-device queues at the first backward pass of a
process; an XLA device that did not exist then fails an internal assert when it trains later.
The plain-CPU reference loops of these tests run backward passes in this process.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def xla_runtime_first() -> None:
    if importlib.util.find_spec("torch_xla") is None:
        return
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch_xla

    torch_xla.device()
