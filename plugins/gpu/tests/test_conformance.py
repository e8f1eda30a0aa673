"""cardcage-gpu against the conformance kit: one process on one CUDA GPU (the training
checks skip, with the reason, where there is none)."""

from __future__ import annotations

from cardcage.testing import BackendSuite, Launch


class TestGPU(BackendSuite):
    backend = "gpu"
    requires_cuda = True
    launches = {"one_gpu": Launch({"distributed_backend": "gpu", "gpus": 1})}
