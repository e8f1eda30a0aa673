"""The GPU tests' isolation, checked on the CPU: :func:`process_state_restored` (which every
test in this folder runs inside) puts back every environment variable a test added, changed
or removed, torch's settings, and a process group the test left behind, so that a GPU test
never trains under another's leftovers."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import torch

Restoring = Callable[[], contextlib.AbstractContextManager[None]]


def test_every_variable_and_setting_a_test_changes_is_put_back(restoring: Restoring) -> None:
    os.environ["CARDCAGE_TEST_CHANGED"] = "before"
    os.environ["CARDCAGE_TEST_REMOVED"] = "before"
    before_env = dict(os.environ)
    before = (
        torch.get_default_dtype(),
        torch.get_num_threads(),
        torch.backends.cudnn.benchmark,
        torch.get_float32_matmul_precision(),
    )
    try:
        with restoring():
            # what an in-process fit leaves behind: rank variables, a hosted store...
            for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
                os.environ[name] = value
            os.environ["CARDCAGE_HOSTED_STORE"] = "1"
            os.environ["CARDCAGE_TEST_CHANGED"] = "after"
            del os.environ["CARDCAGE_TEST_REMOVED"]
            torch.set_default_dtype(torch.float64)
            torch.set_num_threads(1)
            torch.backends.cudnn.benchmark = not before[2]
            torch.set_float32_matmul_precision("medium")
        assert dict(os.environ) == before_env
        after = (
            torch.get_default_dtype(),
            torch.get_num_threads(),
            torch.backends.cudnn.benchmark,
            torch.get_float32_matmul_precision(),
        )
        assert after == before
    finally:
        os.environ.pop("CARDCAGE_TEST_CHANGED", None)
        os.environ.pop("CARDCAGE_TEST_REMOVED", None)


def test_a_process_group_a_test_left_is_destroyed(restoring: Restoring) -> None:
    assert not torch.distributed.is_initialized()
    with restoring():
        torch.distributed.init_process_group(
            "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
        )
        assert torch.distributed.is_initialized()
    assert not torch.distributed.is_initialized()
