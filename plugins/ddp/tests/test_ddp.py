"""Tests of cardcage-ddp. They pass with only cardcage-core and this plugin installed, and in
a full install: every selection loads this plugin alone (``ALONE``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cardcage import MisconfigurationError, sdk, select

ALONE = {"CARDCAGE_PLUGINS_AUTOLOAD": "0", "CARDCAGE_PLUGINS": "ddp"}
TORCHRUN = {"TORCHELASTIC_RUN_ID": "1", "WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}
TORCHRUN.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")  # torchrun sets them


def test_it_is_discovered_through_its_entry_point() -> None:
    found = sdk.registry({}).accelerators["ddp"]
    assert (found.plugin, found.distribution) == ("ddp", "cardcage-ddp")


def test_it_claims_a_multi_node_job(fake_cuda: Callable[[int], None]) -> None:
    fake_cuda(0)
    selection = select(env=ALONE, num_nodes=2)
    assert (selection.accelerator, selection.rule) == ("ddp", "multi_node_or_cluster")
    assert (selection.num_processes, selection.world_size) == (1, 2)


def test_it_claims_processes_torchrun_created(fake_cuda: Callable[[int], None]) -> None:
    fake_cuda(0)
    selection = select(env={**ALONE, **TORCHRUN}, num_nodes=2)
    assert (selection.accelerator, selection.cluster) == ("ddp", "torchelastic")
    assert (selection.world_size, selection.global_rank, selection.local_rank) == (4, 3, 1)


def test_named_it_runs_one_process_per_gpu(fake_cuda: Callable[[int], None]) -> None:
    fake_cuda(2)
    selection = select(env=ALONE, distributed_backend="ddp", gpus=2)
    assert (selection.accelerator, selection.num_processes, selection.world_size) == ("ddp", 2, 2)


def test_named_it_runs_several_cpu_processes(fake_cuda: Callable[[int], None]) -> None:
    fake_cuda(0)
    selection = select(env=ALONE, distributed_backend="ddp", num_processes=3)
    assert (selection.accelerator, selection.num_processes) == ("ddp", 3)


def test_named_for_one_cpu_process_it_hands_the_job_to_the_cpu_backend(
    fake_cuda: Callable[[int], None],
) -> None:
    fake_cuda(0)
    # With cardcage-cpu loaded this trains on the CPU; alone, it says what to install.
    with pytest.raises(MisconfigurationError, match=r"hands the job to the 'cpu'.*cardcage-cpu"):
        select(env=ALONE, distributed_backend="ddp")
