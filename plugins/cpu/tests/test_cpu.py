"""Tests of cardcage-cpu. They pass with only cardcage-core and this plugin installed, and in
a full install: every selection loads this plugin alone (``ALONE``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cardcage import MisconfigurationError, sdk, select

ALONE = {"CARDCAGE_PLUGINS_AUTOLOAD": "0", "CARDCAGE_PLUGINS": "cpu"}


@pytest.fixture
def one_gpu(fake_cuda: Callable[[int], None]) -> None:
    """Torch reports one GPU (the kit's ``fake_cuda``)."""
    fake_cuda(1)


def test_it_is_discovered_through_its_entry_point() -> None:
    found = sdk.registry({}).accelerators["cpu"]
    assert (found.plugin, found.distribution) == ("cpu", "cardcage-cpu")


def test_it_claims_any_job_nobody_else_claims() -> None:
    selection = select(env=ALONE)
    assert (selection.accelerator, selection.rule) == ("cpu", "cpu_fallback")
    assert (selection.num_processes, selection.world_size) == (1, 1)


def test_several_processes_asked_of_it_alone_are_refused_naming_the_plugin() -> None:
    # It used to claim num_processes=4 and train in one process, silently.
    with pytest.raises(MisconfigurationError) as error:
        select(env=ALONE, num_processes=4)
    message = str(error.value)
    assert "num_processes=4 asks for 4 processes" in message
    assert "'cpu', runs 1 per node" in message and "cardcage-spawn" in message


def test_named_it_trains_in_one_process_and_says_so() -> None:
    selection = select(env=ALONE, distributed_backend="cpu", num_processes=2)
    assert (selection.accelerator, selection.num_processes) == ("cpu", 1)
    assert "num_processes=2 is ignored" in selection.warnings[0]


def test_named_it_drops_requested_gpus_and_says_so(one_gpu: None) -> None:
    selection = select(env=ALONE, distributed_backend="cpu", gpus=1)
    assert (selection.accelerator, selection.gpu_ids) == ("cpu", None)
    assert "gpus=1 is ignored" in selection.warnings[0]


def test_it_refuses_several_nodes() -> None:
    with pytest.raises(MisconfigurationError, match=r"'cpu' runs on one node, but num_nodes=2"):
        select(env=ALONE, distributed_backend="cpu", num_nodes=2)
