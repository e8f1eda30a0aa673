"""Shared fixtures: fixed fake GPU counts (``fake_cuda(n)`` comes from the conformance kit's
pytest plugin), and in-process plugins that are always removed."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator

import pytest
import torch

import cardcage
from cardcage.plugins import manager as plugins


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


@pytest.fixture
def inprocess_plugins() -> Iterator[Callable[[object, str], None]]:
    """Register in-process plugins for one test; every one is unregistered afterwards."""
    names: list[str] = []

    def add(plugin: object, name: str) -> None:
        names.append(name)
        plugins.register(plugin, name)

    try:
        yield add
    finally:
        for name in names:
            plugins.unregister(name)
        plugins.clear_cache()


@pytest.fixture
def inprocess_accelerators(
    inprocess_plugins: Callable[[object, str], None],
) -> Callable[..., None]:
    """Register accelerator classes as one in-process plugin: ``add("name", Class, ...)``."""

    def add(name: str, *classes: type) -> None:
        module = types.ModuleType(f"cardcage_{name}")
        module.cardcage_accelerators = cardcage.hookimpl(lambda: list(classes))  # type: ignore[attr-defined]
        inprocess_plugins(module, name)

    return add
