"""The Cage's tests' fixtures; makes ``cage_helpers.py`` importable by name (as
tests/conftest.py does for ``processes``: ``--import-mode=importlib`` leaves this folder off
``sys.path``)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

HERE = str(Path(__file__).resolve().parent)

pytest.register_assert_rewrite("cage_helpers")
if "cage_helpers" not in sys.modules:
    sys.path.insert(0, HERE)
    try:
        importlib.import_module("cage_helpers")
    finally:
        sys.path.remove(HERE)

import cage_helpers  # noqa: E402

from cardcage.testing.harness import Harness  # noqa: E402


@pytest.fixture(scope="session")
def job() -> ModuleType:
    """``scripts/cage_job.py`` imported: the model, the data and the plain loop."""
    return cage_helpers.load_job()


@pytest.fixture(scope="module")
def scenarios(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[cage_helpers.Scenarios]:
    """The module's ``SCENARIOS`` that its selected tests name, started together."""
    table: dict[str, Callable[[Harness], Any]] = request.module.SCENARIOS
    names: list[str] = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if getattr(item, "module", None) is not request.module or callspec is None:
            continue
        name = callspec.params.get("scenario")
        if name is not None and name not in names:
            names.append(name)
    runner = cage_helpers.Scenarios(tmp_path_factory.mktemp("cage"), table, names)
    yield runner
    left = runner.close()
    assert not left, f"processes left behind by the scenarios: {left}"
