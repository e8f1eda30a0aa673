"""The ``cardcage.testing`` pytest plugin: parametrizes a :class:`BackendSuite` subclass.

Registered through the ``pytest11`` entry point of cardcage-core, so a plugin's tests need
only subclass :class:`~cardcage.testing.BackendSuite`. Each check that takes ``launch`` runs
once per declared launch (class-scoped, so a launch's job runs once), and the training
equivalence check once per scenario.

It also gives every test the :func:`fake_cuda` fixture: ``fake_cuda(n)`` makes torch report
``n`` GPUs for the rest of the test, for selection checks on a machine without them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch


def pytest_generate_tests(metafunc: Any) -> None:
    from cardcage.testing.suite import SCENARIOS, SuiteBase

    cls = metafunc.cls
    if cls is None or not issubclass(cls, SuiteBase):
        return
    if "launch" in metafunc.fixturenames:
        names = list(cls.launches)
        metafunc.parametrize("launch", names, ids=names, scope="class")
    if "scenario" in metafunc.fixturenames:
        metafunc.parametrize("scenario", list(SCENARIOS))


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """``fake_cuda(n)``: torch reports ``n`` GPUs until the test ends.

    Selection reads the GPU count through ``torch.cuda.is_available()`` and
    ``torch.cuda.device_count()`` alone, so patching those two is enough to check which
    backend a GPU machine would get. Nothing may train on the fake GPUs.
    """

    def set_count(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    return set_count
