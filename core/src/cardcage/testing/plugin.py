"""The ``cardcage.testing`` pytest plugin: parametrizes a :class:`BackendSuite` subclass.

Registered through the ``pytest11`` entry point of cardcage-core, so a plugin's tests need
only subclass :class:`~cardcage.testing.BackendSuite`. Each check that takes ``launch`` runs
once per declared launch (class-scoped, so a launch's job runs once), and the training
equivalence check once per scenario.
"""

from __future__ import annotations

from typing import Any


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
