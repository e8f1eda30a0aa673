"""The ``cardcage.testing`` pytest plugin: parametrizes a :class:`BackendSuite` subclass.

Registered through the ``pytest11`` entry point of cardcage-core, so a plugin's tests need
only subclass :class:`~cardcage.testing.BackendSuite`. Each check that takes ``launch`` runs
once per declared launch (class-scoped, so a launch's job runs once), and the training
equivalence checks once per scenario (``scenario``: the Trainer's; ``own_loop``: the
own-loop scenarios of :class:`cardcage.Cage`).

It also gives every test three fixtures: ``fake_cuda(n)`` makes torch report ``n`` GPUs for
the rest of the test, for selection checks on a machine without them;
``inprocess_plugins(plugin, name)`` registers a plugin module or object defined in the test
and ``inprocess_accelerators(name, *classes)`` one made of accelerator classes, both
unregistered when the test ends.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from cardcage.backend.accelerator import Accelerator


def pytest_generate_tests(metafunc: Any) -> None:
    from cardcage.testing.suite import OWN_LOOP_SCENARIOS, SCENARIOS, SuiteBase

    cls = metafunc.cls
    if cls is None or not issubclass(cls, SuiteBase):
        return
    if "launch" in metafunc.fixturenames:
        names = list(cls.launches)
        metafunc.parametrize("launch", names, ids=names, scope="class")
    if "scenario" in metafunc.fixturenames:
        metafunc.parametrize("scenario", list(SCENARIOS))
    if "own_loop" in metafunc.fixturenames:
        metafunc.parametrize("own_loop", list(OWN_LOOP_SCENARIOS))


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """``fake_cuda(n)``: torch reports ``n`` GPUs until the test ends.

    Selection reads the GPU count through ``torch.cuda.is_available()`` and
    ``torch.cuda.device_count()`` alone, so patching those two is enough to check which
    backend a GPU machine would get. Nothing may train on the fake GPUs.
    """

    import torch  # here, not at import: pytest loads this plugin in every session

    def set_count(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    return set_count


@pytest.fixture
def inprocess_plugins() -> Iterator[Callable[[object, str], None]]:
    """``inprocess_plugins(plugin, name)``: register a plugin for this test only; every one
    is unregistered (and the loaded registries forgotten) when the test ends."""
    from cardcage.plugins import manager

    names: list[str] = []

    def add(plugin: object, name: str) -> None:
        names.append(name)
        manager.register(plugin, name)

    try:
        yield add
    finally:
        for name in names:
            manager.unregister(name)


@pytest.fixture
def inprocess_accelerators(
    inprocess_plugins: Callable[[object, str], None],
) -> Callable[..., None]:
    """``inprocess_accelerators(name, *classes)``: register accelerator classes as one
    in-process plugin named ``name``, for this test only."""

    from cardcage.plugins.spec import hookimpl

    def add(name: str, *classes: type[Accelerator]) -> None:
        module = types.ModuleType(f"cardcage_{name}")

        @hookimpl
        def cardcage_accelerators() -> list[type[Accelerator]]:
            return list(classes)

        module.cardcage_accelerators = cardcage_accelerators  # type: ignore[attr-defined]
        inprocess_plugins(module, name)

    return add
