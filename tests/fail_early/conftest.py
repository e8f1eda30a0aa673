"""The fail-early tests: every flag and variable refused in the calling process, before any
process, port or CUDA context exists (unit checks and launches alike)."""

from __future__ import annotations

from collections.abc import Callable

import pytest


@pytest.fixture
def cuda_count_0(fake_cuda: Callable[[int], None]) -> int:
    """A machine without GPUs, whatever this one has (the kit's ``fake_cuda``)."""
    fake_cuda(0)
    return 0
