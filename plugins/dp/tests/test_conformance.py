"""cardcage-dp against the conformance kit: DataParallel in one process over the GPUs of
this node (the training checks skip, with the reason, where there is no CUDA GPU)."""

from __future__ import annotations

from cardcage.testing import BackendSuite, Launch


class TestDataParallel(BackendSuite):
    backend = "dp"
    requires_cuda = True
    launches = {"all_gpus": Launch({"distributed_backend": "dp", "gpus": -1})}
