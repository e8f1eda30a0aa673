"""Tests of cardcage-gpu. They pass with only cardcage-core and this plugin installed, and in
a full install: every selection loads this plugin alone (``ALONE``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cardcage import MisconfigurationError, sdk, select

ALONE = {"CARDCAGE_PLUGINS_AUTOLOAD": "0", "CARDCAGE_PLUGINS": "gpu"}


def test_it_is_discovered_through_its_entry_point() -> None:
    found = sdk.registry({}).accelerators["gpu"]
    assert (found.plugin, found.distribution) == ("gpu", "cardcage-gpu")


def test_it_claims_a_job_with_exactly_one_gpu(fake_cuda: Callable[[int], None]) -> None:
    fake_cuda(1)
    selection = select(env=ALONE, gpus=1)
    assert (selection.accelerator, selection.rule, selection.root_gpu) == ("gpu", "single_gpu", 0)


def test_it_trains_on_the_gpu_named_by_id(fake_cuda: Callable[[int], None]) -> None:
    fake_cuda(2)
    selection = select(env=ALONE, gpus="1")
    assert (selection.accelerator, selection.gpu_ids, selection.root_gpu) == ("gpu", [1], 1)


def test_named_with_several_gpus_it_uses_the_first_and_says_so(
    fake_cuda: Callable[[int], None],
) -> None:
    fake_cuda(2)
    selection = select(env=ALONE, distributed_backend="gpu", gpus=2)
    assert (selection.accelerator, selection.root_gpu, selection.num_processes) == ("gpu", 0, 1)
    assert "trains on one GPU" in selection.warnings[0]


def test_named_without_gpus_it_hands_the_job_to_the_cpu_backend(
    fake_cuda: Callable[[int], None],
) -> None:
    fake_cuda(0)
    # With cardcage-cpu loaded this trains on the CPU; alone, it says what to install.
    with pytest.raises(MisconfigurationError, match=r"hands the job to the 'cpu'.*cardcage-cpu"):
        select(env=ALONE, distributed_backend="gpu")


def test_it_refuses_several_nodes(fake_cuda: Callable[[int], None]) -> None:
    fake_cuda(1)
    with pytest.raises(MisconfigurationError, match=r"'gpu' runs on one node, but num_nodes=2"):
        select(env=ALONE, distributed_backend="gpu", gpus=1, num_nodes=2)
