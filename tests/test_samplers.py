"""``distributed_loader`` (what the Trainer's loop and the Cage shard a loader with) on a
loader with a sampler of the user's own: rank by rank here, in one process; the Cage's
2-process run is tests/cage/test_setup_cases.py."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler, SubsetRandomSampler, TensorDataset

from cardcage.backend.strategy.samplers import ShardedSampler, distributed_loader
from cardcage.backend.strategy.strategy import Strategy

SUBSET = [3, 7, 11, 19, 23, 31, 40, 55]


def loader(sampler: Sampler[Any], **settings: Any) -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.arange(64)), batch_size=2, sampler=sampler, **settings)


def seen(shard: DataLoader[Any]) -> list[int]:
    return [int(i) for (batch,) in shard for i in batch]


def epoch_of(shards: list[DataLoader[Any]], epoch: int) -> list[list[int]]:
    """Each rank's indices of ``epoch``, each rank's random state advanced differently
    before it draws (as ranks of a relaunched script or of torchrun may be)."""
    found = []
    for rank, shard in enumerate(shards):
        torch.manual_seed(100 + rank)
        Strategy.on_epoch_start(None, epoch, shard)  # type: ignore[arg-type]  # the loop's call
        found.append(seen(shard))
    return found


def test_a_subset_random_sampler_is_split_into_disjoint_halves_covering_it() -> None:
    user = loader(SubsetRandomSampler(SUBSET))
    shards = [distributed_loader(user, 2, rank) for rank in range(2)]
    orders = []
    for epoch in range(3):
        first, second = epoch_of(shards, epoch)
        assert len(first) == len(second) == 4
        assert not set(first) & set(second), epoch
        assert sorted(first + second) == SUBSET, epoch
        orders.append(first + second)
    assert len({tuple(order) for order in orders}) == 3, "set_epoch must reshuffle"
    for shard in shards:  # the loader's settings kept, the user's sampler inside
        assert isinstance(shard.sampler, ShardedSampler)
        assert shard.sampler.sampler is user.sampler
        assert shard.batch_size == 2
    # the same epoch draws the same order again; drawing leaves the caller's random state
    again = epoch_of(shards, 1)
    torch.manual_seed(5)
    expected = torch.rand(1)
    torch.manual_seed(5)
    list(shards[0].sampler)
    assert torch.rand(1) == expected
    assert again[0] + again[1] == orders[1]


class Recording(Sampler[int]):
    """A sampler of the user's own with its own ``set_epoch``: epoch e yields ``e..e+4``."""

    def __init__(self) -> None:
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self) -> Any:
        start = self.epochs[-1] if self.epochs else 0
        return iter(range(start, start + 5))

    def __len__(self) -> int:
        return 5


def test_set_epoch_reaches_the_users_sampler_and_an_uneven_split_is_padded() -> None:
    user = Recording()
    shards = [distributed_loader(loader(user), 2, rank) for rank in range(2)]
    first, second = epoch_of(shards, 2)
    assert user.epochs == [2, 2]
    assert first == [2, 4, 6] and second == [3, 5, 2]  # DistributedSampler's padding
    dropped = [distributed_loader(loader(user, drop_last=True), 2, r) for r in range(2)]
    assert epoch_of(dropped, 0) == [[0, 2], [1, 3]]


def test_a_sampler_without_a_length_is_left_alone() -> None:
    class Endless(Sampler[int]):
        def __iter__(self) -> Any:
            return iter(range(4))

    endless = loader(Endless())
    assert distributed_loader(endless, 2, 0) is endless
