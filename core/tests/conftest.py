"""Shared fixtures: fixed fake GPU counts. ``fake_cuda(n)``, ``inprocess_plugins`` and
``inprocess_accelerators`` come from the conformance kit's pytest plugin."""

from __future__ import annotations

from collections.abc import Callable

import pytest


# Fixed GPU counts through the kit's fake_cuda: the two calls selection counts GPUs with.
@pytest.fixture
def cuda_count_0(fake_cuda: Callable[[int], None]) -> int:
    fake_cuda(0)
    return 0


@pytest.fixture
def cuda_count_1(fake_cuda: Callable[[int], None]) -> int:
    fake_cuda(1)
    return 1


@pytest.fixture
def cuda_count_2(fake_cuda: Callable[[int], None]) -> int:
    fake_cuda(2)
    return 2


@pytest.fixture
def cuda_count_4(fake_cuda: Callable[[int], None]) -> int:
    fake_cuda(4)
    return 4
