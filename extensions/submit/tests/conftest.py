"""Fixtures of cardcage-submit's tests (they run without the core's tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def cuda_count_0(monkeypatch: pytest.MonkeyPatch) -> int:
    """No GPU, through the two calls selection counts GPUs with (DESIGN.md)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    return 0
