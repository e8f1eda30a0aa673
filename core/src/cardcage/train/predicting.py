"""``trainer.predict``: a model's predictions over loaders, every sample once, in order.

Where it runs is where evaluation (``trainer.validate``/``test``) runs:

- After a fit whose workers were started for it and are gone (``ddp_spawn``, horovod, tpu:
  the trainer holds what they handed back), this process predicts alone, on the CPU, with
  the weights they handed back.
- Otherwise on the trainer's backend, set up first (``cardcage_setup_process``) if nothing
  set this process up yet. In one process that is the whole loader. In a rank of a job of
  several processes (script relaunch, torchrun, srun, horovodrun) the backend gives each
  rank its shard of each loader (``process_dataloader``: a ``DistributedSampler``, which
  deals index ``i`` of its order to rank ``i % world_size`` and pads the order by repeating
  its first samples up to a multiple of the world size). Every rank then sends every other
  rank its predictions (``broadcast`` from each rank in turn, which every backend has), and
  each rank puts them back in the sampler's order, drops the padding and cuts them into the
  loader's own batches: every rank returns what one process would have returned, batch for
  batch. That needs each output split per sample: ``predict_step`` (or ``forward``) must
  return a tensor whose dim 0 is the batch, or a tuple, list or dict of such; anything else
  is refused with the fix. A loader with ``drop_last=True`` is predicted whole and its last
  short batch dropped afterwards, as one process drops it.

A loader with a sampler of the user's own is sharded too (its indices dealt out by a
``ShardedSampler``, a ``DistributedSampler``). A loader the backend does not shard
(``replace_sampler_ddp=False``, a batch sampler of the user's own, a sampler without a
length, an iterable that is not a ``DataLoader``) is predicted by every
rank as it is, and each rank returns its own predictions: no data leaves the rank. A
``DistributedSampler`` of the user's own over this job's ranks counts as sharded.

A shuffling loader in a job of several processes comes back in the order of the job's
sampler (a permutation seeded alike on every rank), not the order a shuffling ``DataLoader``
in one process would have drawn; every sample still comes once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from cardcage.backend.strategy.samplers import _LOADER_SETTINGS
from cardcage.backend.strategy.strategy import Strategy
from cardcage.config.model_contract import batch_size
from cardcage.errors import MisconfigurationError

if TYPE_CHECKING:
    from cardcage.train.trainer import Trainer

__all__ = ["predict"]


def predict(trainer: Trainer, model: torch.nn.Module | None, dataloaders: Any) -> list[Any]:
    """``model``'s predictions over ``dataloaders`` (default: ``model.predict_dataloader()``).

    Each batch gives ``model.predict_step(batch, batch_idx)`` (with ``dataloader_idx`` as a
    third argument when there are several loaders, as Lightning did), or ``model(batch)``
    when the model has no ``predict_step``; tensors in it are moved to the CPU. One loader:
    the list of its batches' outputs; several: one such list per loader, in order. The
    model runs in eval mode without gradients (its mode is put back afterwards) and under
    ``torch.random.fork_rng``, so predicting changes no random state training uses. Under
    several processes, see the module docstring: every rank returns every sample's
    prediction once, in order.
    """
    if model is not None:
        if not isinstance(model, torch.nn.Module):
            raise MisconfigurationError(
                f"predict: model={type(model).__name__} is not a torch.nn.Module. Pass the "
                "module to predict with."
            )
        trainer.model = model
    model = trainer.model
    has_step = callable(getattr(model, "predict_step", None))
    if not has_step and type(model).forward is torch.nn.Module.forward:
        raise MisconfigurationError(
            f"predict: the model {type(model).__name__} has neither predict_step(batch, "
            "batch_idx) nor forward(). Pass trainer.predict(model, ...) with a model that has "
            "one of them."
        )
    if dataloaders is None and callable(getattr(model, "predict_dataloader", None)):
        dataloaders = model.predict_dataloader()  # type: ignore[operator]
    loaders = _loaders(dataloaders)
    if not loaders:
        raise MisconfigurationError(
            "predict: no dataloader. Pass trainer.predict(model, dataloaders=...) or add "
            "predict_dataloader() to the model."
        )
    with trainer.evaluating() as accelerator:
        results = _predict(trainer, accelerator, loaders, has_step)
    return results[0] if len(results) == 1 else results


def _loaders(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def _predict(
    trainer: Trainer, accelerator: Strategy, loaders: list[Any], has_step: bool
) -> list[list[Any]]:
    model = trainer.model
    step = _step_function(trainer, accelerator, model, has_step)
    to_device = accelerator.batch_to_device if accelerator.moves_batches else None
    autocast = accelerator.precision.autocast
    devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    several = len(loaders) > 1
    results: list[list[Any]] = []
    was_training = model.training
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            model.eval()
            for index, loader in enumerate(loaders):
                shard, sampler = _shard(accelerator, loader)
                outputs: list[Any] = []
                sizes: list[int] = []
                for batch_idx, batch in enumerate(shard):
                    sizes.append(batch_size(batch))
                    if to_device is not None:
                        batch = to_device(batch)
                    args = (batch, batch_idx, index) if several else (batch, batch_idx)
                    if autocast is None:
                        output = step(*args)
                    else:
                        with autocast():
                            output = step(*args)
                    outputs.append(_to_cpu(output))
                if sampler is not None:
                    outputs = _gather(accelerator, loader, sampler, outputs, sizes)
                results.append(outputs)
    finally:
        model.train(was_training)
    return results


def _step_function(
    trainer: Trainer, accelerator: Strategy, model: torch.nn.Module, has_step: bool
) -> Callable[..., Any]:
    """The backend's step function for ``predict_step``; without one, ``model(batch)``
    (through the backend's function for ``forward`` where the backend runs the model in a
    wrapper of its own, such as a sharded copy)."""
    if has_step:
        step: Callable[..., Any] = trainer.evaluation_step_function(accelerator, "predict_step")
        return step
    forward = trainer.evaluation_step_function(accelerator, "forward")
    if getattr(forward, "__self__", None) is model:  # the backend calls the model itself
        return lambda batch, batch_idx, *rest: model(batch)
    return lambda batch, batch_idx, *rest: forward(batch)


def _shard(accelerator: Strategy, loader: Any) -> tuple[Any, DistributedSampler[Any] | None]:
    """This rank's loader for ``loader``, and the sampler that sharded it over this job's
    ranks (``None``: not sharded, this rank predicts all of it and keeps its outputs)."""
    world = accelerator.world_size
    if world <= 1:
        return loader, None
    shard = accelerator.process_dataloader(loader, train=False)
    sampler = getattr(shard, "sampler", None)
    if not (
        isinstance(sampler, DistributedSampler)
        and sampler.num_replicas == world
        and sampler.rank == accelerator.global_rank
    ):
        return shard, None
    if isinstance(loader, DataLoader) and loader.drop_last:
        # Each rank would drop samples of its own: predict all of them, and drop the short
        # last batch of the loader's own order after gathering, as one process drops it.
        shard = accelerator.process_dataloader(_keeping_last(loader), train=False)
        sampler = shard.sampler
    return shard, sampler


def _keeping_last(loader: DataLoader[Any]) -> DataLoader[Any]:
    """``loader`` with ``drop_last=False`` and everything else (its sampler too) kept."""
    settings = {name: getattr(loader, name) for name in _LOADER_SETTINGS if hasattr(loader, name)}
    settings["drop_last"] = False
    if not settings.get("num_workers"):
        settings.pop("prefetch_factor", None)
        settings["persistent_workers"] = False
    return type(loader)(loader.dataset, sampler=loader.sampler, **settings)


def _to_cpu(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.detach().cpu()
    if isinstance(output, dict):
        return type(output)((k, _to_cpu(v)) for k, v in output.items())
    if isinstance(output, tuple) and hasattr(output, "_fields"):  # a namedtuple
        return type(output)(*(_to_cpu(v) for v in output))
    if isinstance(output, (list, tuple)):
        return type(output)(_to_cpu(v) for v in output)
    return output


# -- several processes: gather, put back in order, re-batch -----------------------------------


class _Unsplittable(Exception):
    """An output that cannot be cut into one part per sample."""


def _gather(
    accelerator: Strategy,
    loader: DataLoader[Any],
    sampler: DistributedSampler[Any],
    outputs: list[Any],
    sizes: list[int],
) -> list[Any]:
    """Every rank's ``outputs`` of its shard of ``loader``, on every rank, as one process
    would have produced them over the whole loader: batch for batch."""
    world, rank = accelerator.world_size, accelerator.global_rank
    try:
        mine: list[Any] | str = [
            part
            for output, size in zip(outputs, sizes, strict=True)
            for part in _split(output, size)
        ]
    except _Unsplittable as error:
        mine = str(error)  # sent instead of predictions: every rank raises it together
    parts: list[list[Any]] = []
    for source in range(world):
        sender, received = accelerator.broadcast((rank, mine), src=source)
        if sender != source:
            raise RuntimeError(
                f"predict: rank {rank} of {world} did not receive rank {source}'s predictions "
                "(the broadcast returned its own): this process is not connected to the "
                "job's other ranks. Call predict where the job's process group is up: after "
                "fit, or in a process the backend has set up."
            )
        if isinstance(received, str):
            raise MisconfigurationError(received)
        parts.append(received)
    if any(len(p) != sampler.num_samples for p in parts):
        raise RuntimeError(
            f"predict: the ranks predicted {[len(p) for p in parts]} samples, not "
            f"{sampler.num_samples} each as their DistributedSampler deals them; the loader "
            "dropped or added samples. Pass replace_sampler_ddp=False to predict each rank's "
            "loader as it is."
        )
    # Index i of the sampler's order went to rank i % world, as that rank's (i // world)-th.
    ordered = [parts[i % world][i // world] for i in range(sampler.total_size)]
    samples = len(sampler.dataset)  # type: ignore[arg-type]
    del ordered[min(samples, sampler.total_size) :]  # the padding at the end
    size = loader.batch_size or 1
    batches = [ordered[start : start + size] for start in range(0, len(ordered), size)]
    if loader.drop_last and batches and len(batches[-1]) < size:
        batches.pop()
    return [_merge(batch) for batch in batches]


def _split(output: Any, size: int) -> list[Any]:
    """``output`` of a batch of ``size`` samples as ``size`` parts, each with dim 0 of
    length 1 (so that :func:`_merge` puts them back as ``torch.cat`` would)."""
    if isinstance(output, torch.Tensor):
        if output.dim() == 0 or output.shape[0] != size:
            shape = tuple(output.shape)
            raise _Unsplittable(_refusal(f"a tensor of shape {shape} for a batch of {size}"))
        return list(torch.split(output, 1))
    if isinstance(output, dict):
        columns = {k: _split(v, size) for k, v in output.items()}
        return [type(output)((k, columns[k][i]) for k in output) for i in range(size)]
    if isinstance(output, (list, tuple)) and output:
        items = [_split(v, size) for v in output]
        return [_rebuild(output, [item[i] for item in items]) for i in range(size)]
    raise _Unsplittable(_refusal(f"{type(output).__name__} {output!r:.60}"))


def _merge(parts: Sequence[Any]) -> Any:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(parts))
    if isinstance(first, dict):
        return type(first)((k, _merge([p[k] for p in parts])) for k in first)
    return _rebuild(first, [_merge([p[i] for p in parts]) for i in range(len(first))])


def _rebuild(like: Any, items: list[Any]) -> Any:
    if isinstance(like, tuple) and hasattr(like, "_fields"):  # a namedtuple
        return type(like)(*items)
    return type(like)(items)


def _refusal(what: str) -> str:
    return (
        f"predict: predict_step (or forward) returned {what}. In a job of several processes "
        "each rank predicts its shard of the loader and the predictions are put back in the "
        "loader's order sample by sample, which needs tensors whose dim 0 is the batch (or "
        "tuples, lists or dicts of them). Return such tensors from predict_step, or pass "
        "replace_sampler_ddp=False to the Trainer: every rank then predicts the whole "
        "loader and returns its own outputs."
    )
