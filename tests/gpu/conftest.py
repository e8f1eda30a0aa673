"""GPU-only tests: every test marked ``gpu`` under this folder is skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

SKIP_REASON = "needs a CUDA GPU"
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if item.get_closest_marker("gpu") is not None and HERE in item.path.resolve().parents:
            item.add_marker(skip)
