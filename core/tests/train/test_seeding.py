"""cardcage.seed_everything: the same seed draws the same numbers and trains the same
weights; where a missing seed comes from; what is refused."""

from __future__ import annotations

import random

import numpy
import pytest
import torch

import cardcage
from cardcage import MisconfigurationError


def _draws() -> tuple[float, float, list[float]]:
    return random.random(), float(numpy.random.rand()), torch.rand(3).tolist()


def test_one_seed_draws_the_same_from_every_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    assert cardcage.seed_everything(7) == 7
    first = _draws()
    assert cardcage.seed_everything(7) == 7
    assert _draws() == first
    cardcage.seed_everything(8)
    assert _draws() != first
    assert __import__("os").environ["PL_GLOBAL_SEED"] == "8"  # a relaunched rank reads it


def test_the_same_seed_trains_the_same_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)

    def trained() -> list[torch.Tensor]:
        cardcage.seed_everything(3)
        model = torch.nn.Linear(4, 1)
        data = torch.randn(8, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(data).pow(2).mean().backward()
        optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(trained(), trained(), strict=True):
        assert torch.equal(a, b)


def test_a_missing_seed_comes_from_the_environment_or_is_drawn_and_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PL_GLOBAL_SEED", " 11 ")
    assert cardcage.seed_everything() == 11
    monkeypatch.delenv("PL_GLOBAL_SEED")
    with pytest.warns(UserWarning, match=r"no seed given, seed set to \d+") as record:
        seed = cardcage.seed_everything()
    assert str(seed) in str(record[0].message) and 0 <= seed <= 2**32 - 1


@pytest.mark.parametrize("seed", [-1, 2**32, 1.5, True, "x"])
def test_a_seed_that_is_no_seed_is_refused(seed: object) -> None:
    with pytest.raises(MisconfigurationError, match=r"seed=.* is not a seed: give an integer"):
        cardcage.seed_everything(seed)  # type: ignore[arg-type]


def test_a_bad_seed_variable_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PL_GLOBAL_SEED", "abc")
    with pytest.raises(MisconfigurationError, match=r"variable PL_GLOBAL_SEED='abc'"):
        cardcage.seed_everything()


def test_seeding_workers_is_refused_by_name() -> None:
    with pytest.raises(MisconfigurationError, match=r"workers=True\) is not supported yet"):
        cardcage.seed_everything(1, workers=True)
