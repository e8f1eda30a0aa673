"""cardcage-cpu against the conformance kit (cardcage.testing): it trains in this process."""

from __future__ import annotations

from cardcage.testing import BackendSuite, Launch


class TestCPU(BackendSuite):
    backend = "cpu"
    launches = {"in_process": Launch({"distributed_backend": "cpu"})}
