"""Shared fixtures: fixed fake GPU counts. ``fake_cuda(n)``, ``inprocess_plugins`` and
``inprocess_accelerators`` come from the conformance kit's pytest plugin."""

from __future__ import annotations

import pytest
import torch


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, count: int) -> int:
    # The two calls selection uses to count GPUs (docs/choosing-a-backend.md says so, and that
    # tests may patch them); nothing else is patched, so a code path that reaches for CUDA some
    # other way shows up in a test.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    return count


@pytest.fixture
def cuda_count_0(monkeypatch: pytest.MonkeyPatch) -> int:
    return _fake_cuda(monkeypatch, 0)


@pytest.fixture
def cuda_count_1(monkeypatch: pytest.MonkeyPatch) -> int:
    return _fake_cuda(monkeypatch, 1)


@pytest.fixture
def cuda_count_2(monkeypatch: pytest.MonkeyPatch) -> int:
    return _fake_cuda(monkeypatch, 2)


@pytest.fixture
def cuda_count_4(monkeypatch: pytest.MonkeyPatch) -> int:
    return _fake_cuda(monkeypatch, 4)
