"""Running a model's step methods through a wrapper that only calls ``forward``.

DataParallel replicates a module and DistributedDataParallel synchronises gradients only
for calls that go through ``forward``. :class:`StepRunner` makes ``forward(name, batch,
batch_idx)`` run ``model.<name>(batch, batch_idx)``, so the user's ``training_step`` runs
inside the wrapper, as Lightning's ``LightningDistributedModule`` did.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: The step name under which :class:`StepRunner` calls the module itself with the caller's
#: arguments (a :class:`cardcage.Cage` user's ``model(x, ...)``).
CALL = "__call__"


class StepRunner(torch.nn.Module):
    """``forward(name, batch, batch_idx, ...)`` → ``module.<name>(batch, batch_idx, ...)``;
    ``forward(CALL, *args, **kwargs)`` → ``module(*args, **kwargs)``.

    ``autocast``, when given, is entered inside ``forward``: autocast state is thread-local
    and DataParallel runs each replica in its own thread.
    """

    def __init__(self, module: torch.nn.Module, autocast: Callable[[], Any] | None = None):
        super().__init__()
        self.module = module
        self.autocast = autocast

    def forward(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if name == CALL:
            step: Callable[..., Any] = self.module
        elif name == "forward":  # the model's own forward (a prediction without predict_step)
            args, kwargs, step = args[:2], {}, _batch_only(self.module.forward)
        else:
            step = getattr(self.module, name)
        if self.autocast is None:
            return step(*args, **kwargs)
        with self.autocast():
            return step(*args, **kwargs)


def runner_in(module: torch.nn.Module) -> StepRunner | None:
    """The :class:`StepRunner` that ``module`` is or wraps (``DataParallel(StepRunner)``,
    ``DistributedDataParallel(StepRunner)``), called as ``module(name, *args)``; else None."""
    inner = getattr(module, "module", None)
    for candidate in (module, inner):
        if isinstance(candidate, StepRunner):
            return candidate
    return None


def trained_module(module: torch.nn.Module) -> torch.nn.Module:
    """The module that a backend's ``setup_module`` result trains: the model the
    :class:`StepRunner` in it runs, else ``module`` itself (the model, or its replacement)."""
    runner = runner_in(module)
    return runner.module if runner is not None else module


def _batch_only(forward: Callable[..., Any]) -> Callable[..., Any]:
    return lambda batch, batch_idx: forward(batch)


def replica_shares(batch: Any, replicas: int) -> list[int] | None:
    """How many samples of ``batch`` each DataParallel replica gets: DataParallel scatters
    every tensor in chunks along dimension 0 as ``tensor.chunk(replicas)`` cuts it (the
    first tensor found decides), so a batch of 3 on 2 GPUs is 2 + 1 and one of 5 on 4 is
    2 + 2 + 1 (three replicas run). ``None``: no tensor to split."""
    first = _first_tensor(batch)
    if first is None or first.dim() == 0 or replicas < 1:
        return None
    size = first.size(0)
    chunk = -(-size // replicas)  # ceil, as torch.chunk
    return [min(chunk, size - start) for start in range(0, size, chunk)] if size else None


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    items = batch.values() if isinstance(batch, dict) else batch
    if isinstance(items, (list, tuple)) or isinstance(batch, dict):
        for item in items:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def reduce_replica_outputs(output: Any, shares: list[int] | None = None) -> Any:
    """Reduce what DataParallel replicas returned (gathered along dimension 0) to what one
    replica over the whole batch would have returned.

    A scalar per replica (a loss, a logged value: gathered into one value per replica) is
    the mean over the replicas weighted by ``shares``, each replica's number of samples
    (:func:`replica_shares`): a batch that splits unevenly (3 on 2 GPUs: 2 + 1) then gives
    the full batch's mean loss, as the plain loop computes it. Without ``shares``, or when
    the replicas got equal shares, it is the plain mean. Other tensors (gathered
    per-sample values) are averaged over all their elements.
    """
    if isinstance(output, torch.Tensor):
        if not output.dim():
            return output
        uneven = shares is not None and len(set(shares)) > 1 and output.shape == (len(shares),)
        if uneven:
            assert shares is not None
            total = sum(shares)
            values = output.float()
            return sum(values[i] * (share / total) for i, share in enumerate(shares))
        return output.float().mean()
    if isinstance(output, dict):
        return {k: reduce_replica_outputs(v, shares) for k, v in output.items()}
    return output


def data_parallel_step(
    parallel: torch.nn.Module, model: torch.nn.Module, name: str
) -> Callable[..., Any]:
    """A step function running ``name`` in DataParallel replicas, reduced like Lightning 1.0.

    A model's ``<name>_end(outputs)`` (e.g. ``training_step_end``) receives the gathered
    outputs; without one every gathered tensor is reduced by
    :func:`reduce_replica_outputs`, each replica weighted by its share of the batch.
    """
    reduce_end = getattr(model, f"{name}_end", None)
    replicas = len(getattr(parallel, "device_ids", None) or ()) or 1

    if name in ("predict_step", "forward", CALL):  # per sample, as gathered

        def predict(batch: Any, batch_idx: int = 0, *args: Any, **kwargs: Any) -> Any:
            return parallel(name, batch, batch_idx, *args, **kwargs)

        return predict

    def step(batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        output = parallel(name, batch, batch_idx, *args, **kwargs)
        if callable(reduce_end):
            return reduce_end(output)
        return reduce_replica_outputs(output, replica_shares(batch, replicas))

    step.calls_step_end = True  # type: ignore[attr-defined]  # the loop must not call it again
    return step


def convert_batchnorm(module: torch.nn.Module, sync_class: Callable[..., Any]) -> torch.nn.Module:
    """``module`` with every batch-norm layer replaced by ``sync_class`` (an engine's own
    synchronised batch norm, built like ``torch.nn.BatchNorm1d``), weights, running
    statistics and train/eval mode kept. torch's ``SyncBatchNorm.convert_sync_batchnorm``
    does the same for ``torch.nn.SyncBatchNorm`` alone."""
    converted = module
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
        converted = sync_class(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
        )
        converted.load_state_dict(module.state_dict())
        converted.train(module.training)
    for name, child in module.named_children():
        converted.add_module(name, convert_batchnorm(child, sync_class))
    return converted
