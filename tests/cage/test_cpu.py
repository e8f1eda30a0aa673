"""``cardcage.Cage()`` on one CPU process: ``launch`` runs the function here, and ``setup``
hands back the user's own module, optimizer and loader, so the loop is the plain loop's
code and ends with the same weights, bit for bit."""

from __future__ import annotations

from typing import Any

import processes
import pytest
import torch
from torch.utils.data import DataLoader

import cardcage


def run(cage: cardcage.Cage, job: Any, make_optimizer: Any) -> list[torch.Tensor]:
    """The loop through the Cage; the objects setup returns must be the ones passed."""
    model = job.make_model()
    optimizer = make_optimizer(model)
    loader = DataLoader(job.dataset(), batch_size=8, shuffle=True)
    ready, ready_optimizer = cage.setup(model, optimizer)
    ready_loader = cage.setup_dataloaders(loader)
    assert ready is model and ready_optimizer is optimizer and ready_loader is loader
    assert (cage.world_size, cage.global_rank, cage.device) == (1, 0, torch.device("cpu"))
    job.train(ready, ready_optimizer, ready_loader, 2, cage.backward)
    return [parameter.detach().clone() for parameter in model.parameters()]


def plain(job: Any, make_optimizer: Any) -> list[torch.Tensor]:
    model = job.make_model()
    optimizer = make_optimizer(model)
    loader = DataLoader(job.dataset(), batch_size=8, shuffle=True)
    job.train(model, optimizer, loader, 2, job.plain_backward)
    return [parameter.detach().clone() for parameter in model.parameters()]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_the_cage_on_the_cpu_is_bit_equal_to_the_plain_loop(job: Any, optimizer: str) -> None:
    make_optimizer = getattr(job, optimizer)
    torch.manual_seed(0)  # the shuffle draws from the global generator, in both runs
    with processes.watching_children() as started:
        got = cardcage.Cage().launch(run, job, make_optimizer)
    assert not started, "launch started processes for a one-process job"
    torch.manual_seed(0)
    expected = plain(job, make_optimizer)
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected, strict=True):
        assert torch.equal(mine, theirs)
    assert not torch.equal(got[0], job.make_model().state_dict()["0.weight"])  # it trained
