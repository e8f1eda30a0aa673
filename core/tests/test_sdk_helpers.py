"""Helpers of the SDK that backends reuse, first written for the horovod backend."""

from __future__ import annotations

import logging

import pytest
import torch

import cardcage
from cardcage import select
from cardcage.sdk import Accelerator, SpawnLauncher, named_parameters


class Probe(Accelerator):
    name = "probe"


def probe(global_rank: int) -> Probe:
    accelerator = Probe(select(env={}))
    accelerator.global_rank = global_rank
    return accelerator


def test_named_parameters_use_the_models_names_and_name_the_rest() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    extra = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([extra, *model[1].parameters()], lr=0.1)
    named = named_parameters(model, optimizer)
    assert [name for name, _ in named] == ["1.weight", "1.bias", "unnamed.0"]
    assert [p for _, p in named] == [model[1].weight, model[1].bias, extra]
    # parameters the optimizer does not hold are not named
    assert named_parameters(model, torch.optim.SGD(model[0].parameters(), lr=0.1)) == [
        ("0.weight", model[0].weight),
        ("0.bias", model[0].bias),
    ]


def test_even_ranks_have_no_rank_to_continue_from(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="cardcage"):
        assert probe(0).uneven_source(0, [5, 5, 5]) is None
        assert probe(0).uneven_source(0, [5]) is None
    assert caplog.records == []


def test_uneven_ranks_continue_from_the_first_that_trained_most(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rank_0 = probe(0)
    with caplog.at_level(logging.WARNING, logger="cardcage"):
        assert rank_0.uneven_source(3, [8, 12, 12]) == 1
        assert rank_0.uneven_source(4, [9, 7, 8]) == 0
    (record,) = caplog.records  # rank 0 warns once per process
    message = record.getMessage()
    assert "the probe ranks trained on uneven numbers of batches in epoch 3" in message
    assert "(rank 0: 8, rank 1: 12, rank 2: 12)" in message
    assert "from rank 1's weights and optimizer state" in message


def test_only_rank_0_warns_about_uneven_ranks(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="cardcage"):
        assert probe(1).uneven_source(0, [8, 12]) == 1
    assert caplog.records == []


def test_a_worker_launcher_names_num_processes_when_it_asks_for_several(
    cuda_count_0: int,
) -> None:
    several = cardcage.Trainer(distributed_backend="ddp_spawn", num_processes=2)
    launcher = SpawnLauncher(several.accelerator)
    assert launcher.describe(several) == "distributed_backend='ddp_spawn' with num_processes=2"
    one = cardcage.Trainer(distributed_backend="ddp_spawn", gpus=None, num_nodes=2)
    assert SpawnLauncher(one.accelerator).describe(one) == "distributed_backend='ddp_spawn'"


def test_a_rank_knows_its_node_and_whether_it_hands_results_back() -> None:
    """What a sharded gather_state needs to know without a collective: this rank's node,
    and the ranks (each node's local rank 0) whose state is handed back to the caller."""
    env = {"NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    selection = select(env=env, distributed_backend="ddp_cpu", num_processes=3, num_nodes=2)
    accelerator = Probe(selection)
    assert (accelerator.node_rank, accelerator.world_size) == (1, 6)
    assert accelerator.hand_back_ranks == [0, 3]
    accelerator.global_rank, accelerator.local_rank = 3, 0
    assert accelerator.hands_back_results and not accelerator.is_global_zero
    accelerator.global_rank, accelerator.local_rank = 4, 1
    assert not accelerator.hands_back_results
    assert Probe(select(env={})).hand_back_ranks == [0]
