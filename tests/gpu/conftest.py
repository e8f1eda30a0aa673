"""GPU-only tests: every test marked ``gpu`` under this folder is skipped without CUDA.

Every test here runs inside :func:`process_state_restored`: whatever it (or a ``fit`` it
runs in this process) changes in the process is put back before the next test, so that no
test trains under another's leftovers (``RANK``/``WORLD_SIZE`` of an in-process fsdp fit
would turn the next ``fsdp_spawn`` fit into a torchelastic job of one process). The snapshot
is this file's own, independent of what cardcage itself restores after a fit.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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


def _torch_settings() -> dict[str, tuple[Callable[[], Any], Callable[[Any], None]]]:
    """torch's process-wide settings a test or a fit may change: name -> (read, write).
    Reading them creates no CUDA context."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul

    def attribute(owner: Any, name: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
        return (lambda: getattr(owner, name)), (lambda value: setattr(owner, name, value))

    settings = {f"cudnn.{name}": attribute(cudnn, name) for name in ("benchmark", "deterministic")}
    settings["cudnn.allow_tf32"] = attribute(cudnn, "allow_tf32")
    settings["cuda.matmul.allow_tf32"] = attribute(matmul, "allow_tf32")
    settings["default_dtype"] = (torch.get_default_dtype, torch.set_default_dtype)
    settings["num_threads"] = (torch.get_num_threads, torch.set_num_threads)
    settings["float32_matmul_precision"] = (
        torch.get_float32_matmul_precision,
        torch.set_float32_matmul_precision,
    )
    return settings


def _group_initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@contextlib.contextmanager
def process_state_restored() -> Iterator[None]:
    """Put back, when the block ends, everything in this process it may have changed: every
    environment variable (added, changed or removed, not only the CUDA ones), torch's
    process-wide settings (cuDNN and TF32 flags, default dtype, threads, matmul precision),
    a process group it left initialized, and the current CUDA device."""
    environ = dict(os.environ)
    settings = _torch_settings()
    saved = {name: read() for name, (read, _) in settings.items()}
    had_group = _group_initialized()
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    try:
        yield
    finally:
        if _group_initialized() and not had_group:
            torch.distributed.destroy_process_group()
        for name in [name for name in os.environ if name not in environ]:
            del os.environ[name]
        for name, value in environ.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
        for name, (_, write) in settings.items():
            write(saved[name])
        if torch.cuda.is_initialized():
            torch.cuda.set_device(device)


@pytest.fixture(autouse=True)
def _isolated_process() -> Iterator[None]:
    """Deterministic cuDNN for the comparisons, inside :func:`process_state_restored`."""
    with process_state_restored():
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        yield


@pytest.fixture
def restoring() -> Callable[[], contextlib.AbstractContextManager[None]]:
    """:func:`process_state_restored`, for the test that checks what it puts back."""
    return process_state_restored
