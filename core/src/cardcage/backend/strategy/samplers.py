"""Sharding a dataloader across processes without changing how the user built it."""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

__all__ = ["distributed_loader"]

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


def distributed_loader(loader: Any, num_replicas: int, rank: int) -> Any:
    """``loader`` with a ``DistributedSampler`` in place of its default sampler.

    Shuffles only if the user shuffled; keeps batch size, workers, collate function,
    ``drop_last`` and the rest. A loader with the user's own sampler or batch sampler, or
    one that is not a ``DataLoader``, is returned unchanged.
    """
    if not isinstance(loader, DataLoader) or isinstance(loader.sampler, DistributedSampler):
        return loader
    if type(loader.sampler) not in (RandomSampler, SequentialSampler):
        return loader
    if loader.batch_sampler is not None and type(loader.batch_sampler).__name__ != "BatchSampler":
        return loader
    if loader.batch_size is None:
        return loader
    shuffle = isinstance(loader.sampler, RandomSampler)
    sampler: DistributedSampler[Any] = DistributedSampler(
        loader.dataset,
        num_replicas=num_replicas,
        rank=rank,
        shuffle=shuffle,
        drop_last=loader.drop_last,
    )
    settings = {name: getattr(loader, name) for name in _LOADER_SETTINGS if hasattr(loader, name)}
    if not settings.get("num_workers"):
        settings.pop("prefetch_factor", None)
        settings["persistent_workers"] = False
    return type(loader)(loader.dataset, sampler=sampler, **settings)
