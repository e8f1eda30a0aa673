"""Sharding a dataloader across processes without changing how the user built it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

__all__ = ["ShardedSampler", "distributed_loader"]

# DataLoader settings carried over when the sampler is replaced.
_LOADER_SETTINGS = (
    "batch_size",
    "num_workers",
    "collate_fn",
    "pin_memory",
    "drop_last",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
)


class _Drawn(Dataset[Any]):
    """What :class:`ShardedSampler` deals out: the user's sampler's indices of one epoch."""

    def __init__(self, sampler: Sampler[Any] | Iterable[Any]):
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __getitem__(self, position: int) -> Any:
        raise TypeError("ShardedSampler draws its sampler's indices in __iter__")


class ShardedSampler(DistributedSampler[Any]):
    """The user's own ``sampler``, sharded across ranks as ``DistributedSampler`` shards a
    dataset: each epoch the sampler's indices are drawn once, in the same order on every
    rank, and rank ``r`` of ``N`` takes every ``N``-th of them (the order padded by its
    first indices to a multiple of ``N``, or cut with ``drop_last``).

    The draw runs with torch's global generator seeded by ``seed + epoch`` (and put back
    afterwards), as ``DistributedSampler`` seeds its shuffle, so ranks whose random states
    differ (script relaunch, torchrun) still draw the same order; a sampler with a
    generator of its own draws from it, which must then agree on every rank.
    :meth:`set_epoch` reaches the sampler too when it has one.
    """

    def __init__(
        self,
        sampler: Sampler[Any] | Iterable[Any],
        num_replicas: int,
        rank: int,
        *,
        drop_last: bool = False,
        seed: int = 0,
    ):
        self.sampler = sampler
        super().__init__(
            _Drawn(sampler),
            num_replicas=num_replicas,
            rank=rank,
            shuffle=False,
            seed=seed,
            drop_last=drop_last,
        )

    def __iter__(self) -> Iterator[Any]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + self.epoch)
            drawn = list(self.sampler)
        positions = list(super().__iter__())
        return iter([drawn[position] for position in positions])

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        own = getattr(self.sampler, "set_epoch", None)
        if callable(own):
            own(epoch)


def distributed_loader(loader: Any, num_replicas: int, rank: int) -> Any:
    """``loader`` with a ``DistributedSampler`` in place of its sampler.

    The default sampler becomes a ``DistributedSampler`` of the dataset that shuffles only
    if the user shuffled; a sampler of the user's own (``SubsetRandomSampler``, a weighted
    one: any sampler with a length) is wrapped in a :class:`ShardedSampler`, which deals its
    indices out across the ranks. Keeps batch size, workers, collate function,
    ``drop_last`` and the rest. A loader with a batch sampler of the user's own, a sampler
    without a length, or one that is not a ``DataLoader``, is returned unchanged.
    """
    if not isinstance(loader, DataLoader) or isinstance(loader.sampler, DistributedSampler):
        return loader
    if loader.batch_sampler is not None and type(loader.batch_sampler).__name__ != "BatchSampler":
        return loader
    if loader.batch_size is None:
        return loader
    sampler: DistributedSampler[Any]
    if type(loader.sampler) in (RandomSampler, SequentialSampler):
        sampler = DistributedSampler(
            loader.dataset,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=isinstance(loader.sampler, RandomSampler),
            drop_last=loader.drop_last,
        )
    elif isinstance(loader.sampler, Sized):
        sampler = ShardedSampler(
            loader.sampler, num_replicas, rank, drop_last=bool(loader.drop_last)
        )
    else:
        return loader
    settings = {name: getattr(loader, name) for name in _LOADER_SETTINGS if hasattr(loader, name)}
    if not settings.get("num_workers"):
        settings.pop("prefetch_factor", None)
        settings["persistent_workers"] = False
    return type(loader)(loader.dataset, sampler=sampler, **settings)
