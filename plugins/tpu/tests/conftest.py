"""Where torch_xla is installed, start XLA's CPU device before any test runs a backward pass.

PyTorch's autograd engine sizes its per-device queues at the first backward pass of a
process; an XLA device that did not exist then fails an internal assert when it trains later.
The plain-CPU reference loops of these tests run backward passes in this process.

Without torch_xla the tests that need it skip with the reason; under CI (``CI`` set) those
skips are failures with the same reason, since the tpu session exists to run them on XLA.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Generator

import pytest

XLA_MISSING = importlib.util.find_spec("torch_xla") is None
NAMES_XLA = re.compile(r"torch[-_]xla", re.IGNORECASE)


def _under_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Under CI, a skip because torch_xla is missing (a ``skipif`` marker or an
    ``importorskip``, whatever the test file) becomes a failure with the same reason."""
    report = yield
    if report.skipped and XLA_MISSING and _under_ci() and not hasattr(report, "wasxfail"):
        longrepr = report.longrepr
        reason = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)
        reason = reason.removeprefix("Skipped: ")
        if NAMES_XLA.search(reason):
            report.outcome = "failed"
            report.longrepr = f"under CI: {reason}"
    return report


@pytest.fixture(scope="session", autouse=True)
def xla_runtime_first() -> None:
    if XLA_MISSING:
        return
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch_xla

    torch_xla.device()
