"""What a fit changes in its process is put back when it ends (``cardcage.train.process_state``):
each kind of setting, changed as a fit (or a backend, or the user's hooks) changes it.

The whole path, real fits in a row in one process, is tested in
``tests/distributed/test_process_as_found.py``; CUDA, which this machine lacks, only here.
"""

from __future__ import annotations

import os
import signal
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from cardcage.train.process_state import Snapshot, as_found


def test_variables_added_changed_and_removed_are_put_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CARDCAGE_TEST_KEPT", "before")
    monkeypatch.setenv("CARDCAGE_TEST_REMOVED", "before")
    monkeypatch.delenv("CARDCAGE_TEST_ADDED", raising=False)
    before = dict(os.environ)
    snapshot = Snapshot.take()
    os.environ["CARDCAGE_TEST_KEPT"] = "changed"
    os.environ["CARDCAGE_TEST_ADDED"] = "1"
    del os.environ["CARDCAGE_TEST_REMOVED"]
    snapshot.restore(returned=True, outside=False)
    assert dict(os.environ) == before


def test_torch_settings_hooks_and_handlers_are_put_back() -> None:
    threads, benchmark = torch.get_num_threads(), torch.backends.cudnn.benchmark
    hook, handler = sys.excepthook, signal.getsignal(signal.SIGUSR1)
    snapshot = Snapshot.take()
    torch.set_num_threads(threads + 1)
    torch.backends.cudnn.benchmark = not benchmark
    torch.set_default_dtype(torch.float64)
    sys.excepthook = lambda *args: None
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    try:
        snapshot.restore(returned=False, outside=False)
        assert torch.get_num_threads() == threads
        assert torch.backends.cudnn.benchmark is benchmark
        assert torch.get_default_dtype() is torch.float32
        assert sys.excepthook is hook
        assert signal.getsignal(signal.SIGUSR1) is handler
        assert not snapshot.failed
    finally:  # whatever the outcome, this test process goes on as it was
        torch.set_num_threads(threads)
        torch.backends.cudnn.benchmark = benchmark
        torch.set_default_dtype(torch.float32)
        sys.excepthook = hook
        signal.signal(signal.SIGUSR1, handler)


def test_a_fit_that_raises_is_undone_and_its_error_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trainer = SimpleNamespace(selection=SimpleNamespace(processes_created_outside=False))
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="training_step failed"), as_found(trainer):
        os.environ["RANK"] = "0"
        raise RuntimeError("training_step failed")
    assert "RANK" not in os.environ


def test_the_cuda_device_a_gpu_fit_chose_is_put_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-GPU fit calls ``torch.cuda.set_device``; afterwards the process is back on
    CUDA's default device. (No GPU here: CUDA's state is simulated.)"""
    cuda: dict[str, Any] = {"started": False, "device": 0}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: cuda["started"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: cuda["device"])
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: cuda.update(device=device))
    snapshot = Snapshot.take()  # reads nothing from CUDA before it started
    cuda.update(started=True, device=1)  # the fit: CUDA starts, set_device(1)
    snapshot.restore(returned=True, outside=False)
    assert cuda["device"] == 0
