"""Tests of cardcage-ddp2. They pass with only cardcage-core and this plugin installed, and in
a full install: every selection loads this plugin alone (``ALONE``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cardcage import MisconfigurationError, sdk, select

ALONE = {"CARDCAGE_PLUGINS_AUTOLOAD": "0", "CARDCAGE_PLUGINS": "ddp2"}


def test_it_is_discovered_through_its_entry_point() -> None:
    found = sdk.registry({}).accelerators["ddp2"]
    assert (found.plugin, found.distribution) == ("ddp2", "cardcage-ddp2")
    assert found.cls.rules == ()  # only ever chosen by name


def test_named_it_runs_one_process_per_node_over_its_gpus(fake_cuda: Callable[[int], None]) -> None:
    fake_cuda(4)
    selection = select(env=ALONE, distributed_backend="ddp2", gpus=4, num_nodes=2)
    assert (selection.accelerator, selection.num_processes, selection.world_size) == ("ddp2", 1, 2)
    assert selection.gpu_ids == [0, 1, 2, 3]
    assert selection.warnings == []


def test_slurm_manages_one_task_per_node(fake_cuda: Callable[[int], None]) -> None:
    fake_cuda(2)
    slurm = {"SLURM_NTASKS": "2", "SLURM_JOB_NAME": "train", "SLURM_PROCID": "1"}
    selection = select(env={**ALONE, **slurm}, distributed_backend="ddp2", gpus=2, num_nodes=2)
    assert (selection.cluster, selection.global_rank) == ("slurm", 1)


def test_without_gpus_on_several_nodes_each_node_trains_on_the_cpu(
    fake_cuda: Callable[[int], None],
) -> None:
    fake_cuda(0)
    selection = select(env=ALONE, distributed_backend="ddp2", num_nodes=3)
    assert (selection.accelerator, selection.world_size) == ("ddp2", 3)
    assert "each of the 3 nodes trains one process on the CPU" in selection.warnings[0]


def test_without_gpus_on_one_node_it_hands_the_job_to_the_cpu_backend(
    fake_cuda: Callable[[int], None],
) -> None:
    fake_cuda(0)
    # With cardcage-cpu loaded this trains on the CPU; alone, it says what to install.
    with pytest.raises(MisconfigurationError, match=r"hands the job to the 'cpu'.*cardcage-cpu"):
        select(env=ALONE, distributed_backend="ddp2")
