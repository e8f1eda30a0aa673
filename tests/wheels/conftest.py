"""Runs the installed-wheels tests of this folder only when asked for.

They make virtual environments from the wheels in dist/ (``nox -s build``) and take a few
minutes: ``nox -s wheels`` (which builds dist/ first), ``pytest tests/wheels``, or any run
with ``CARDCAGE_WHEELS_TESTS=1``. A broader run (``pytest``, ``pytest tests``, the core
session) skips them with that reason.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ENABLE = "CARDCAGE_WHEELS_TESTS"


def _asked_for(config: pytest.Config) -> bool:
    if os.environ.get(ENABLE, "") not in ("", "0"):
        return True
    for arg in config.args:
        path = (Path(config.invocation_params.dir) / arg.split("::")[0]).resolve()
        if path == HERE or HERE in path.parents:
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _asked_for(config):
        return
    skip = pytest.mark.skip(
        reason="the installed-wheels tests make virtual environments from dist/: run "
        f"`nox -s wheels`, `pytest tests/wheels` after `nox -s build`, or set {ENABLE}=1"
    )
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(skip)
