"""Tests of cardcage-spawn. They pass with only cardcage-core and this plugin installed, and in
a full install: every selection loads this plugin alone (``ALONE``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cardcage import MisconfigurationError, sdk, select

ALONE = {"CARDCAGE_PLUGINS_AUTOLOAD": "0", "CARDCAGE_PLUGINS": "spawn"}
TORCHRUN = {"TORCHELASTIC_RUN_ID": "1", "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
TORCHRUN.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")  # torchrun sets them


def test_it_is_discovered_with_its_aliases() -> None:
    registry = sdk.registry({})
    found = registry.accelerators["ddp_spawn"]
    assert (found.plugin, found.distribution) == ("spawn", "cardcage-spawn")
    assert registry.canonical("spawn") == registry.canonical("ddp_cpu") == "ddp_spawn"


def test_it_claims_several_gpus_with_the_seeds_warning(fake_cuda: Callable[[int], None]) -> None:
    fake_cuda(2)
    selection = select(env=ALONE, gpus=2)
    assert (selection.accelerator, selection.rule, selection.num_processes) == (
        "ddp_spawn",
        "multi_gpu",
        2,
    )
    assert 'Setting distributed_backend="ddp_spawn" for you.' in selection.warnings[0]


def test_it_claims_several_cpu_processes(fake_cuda: Callable[[int], None]) -> None:
    fake_cuda(0)
    selection = select(env=ALONE, num_processes=3)
    assert (selection.accelerator, selection.rule, selection.world_size) == (
        "ddp_spawn",
        "cpu_processes",
        3,
    )


def test_ddp_cpu_trains_on_the_cpu_even_with_gpus(fake_cuda: Callable[[int], None]) -> None:
    fake_cuda(2)
    selection = select(env=ALONE, distributed_backend="ddp_cpu", gpus=2, num_processes=2)
    assert (selection.accelerator, selection.gpu_ids, selection.num_processes) == (
        "ddp_spawn",
        None,
        2,
    )
    assert "Training will not use GPUs" in selection.warnings[0]


def test_where_torchrun_made_the_processes_it_hands_the_job_to_ddp(
    fake_cuda: Callable[[int], None],
) -> None:
    fake_cuda(0)
    # With cardcage-ddp loaded this runs as 'ddp'; alone, it says what to install.
    with pytest.raises(MisconfigurationError, match=r"hands the job to the 'ddp'.*cardcage-ddp"):
        select(env={**ALONE, **TORCHRUN}, distributed_backend="spawn")
