"""Tests of cardcage-dp. They pass with only cardcage-core and this plugin installed, and in
a full install: every selection loads this plugin alone (``ALONE``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cardcage import MisconfigurationError, sdk, select

ALONE = {"CARDCAGE_PLUGINS_AUTOLOAD": "0", "CARDCAGE_PLUGINS": "dp"}


def test_it_is_discovered_through_its_entry_point() -> None:
    found = sdk.registry({}).accelerators["dp"]
    assert (found.plugin, found.distribution) == ("dp", "cardcage-dp")
    assert found.cls.rules == ()  # DataParallel is only ever chosen by name


def test_named_it_runs_one_process_over_every_gpu(fake_cuda: Callable[[int], None]) -> None:
    fake_cuda(2)
    selection = select(env=ALONE, distributed_backend="dp", gpus=-1)
    assert (selection.accelerator, selection.num_processes, selection.world_size) == ("dp", 1, 1)
    assert (selection.gpu_ids, selection.root_gpu) == ([0, 1], 0)


def test_named_without_gpus_it_hands_the_job_to_the_cpu_backend(
    fake_cuda: Callable[[int], None],
) -> None:
    fake_cuda(0)
    # With cardcage-cpu loaded this trains on the CPU; alone, it says what to install.
    with pytest.raises(MisconfigurationError, match=r"hands the job to the 'cpu'.*cardcage-cpu"):
        select(env=ALONE, distributed_backend="dp")


def test_it_refuses_several_nodes(fake_cuda: Callable[[int], None]) -> None:
    fake_cuda(2)
    with pytest.raises(MisconfigurationError, match=r"'dp' runs on one node.*'ddp'"):
        select(env=ALONE, distributed_backend="dp", gpus=2, num_nodes=2)
