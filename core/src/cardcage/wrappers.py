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


class StepRunner(torch.nn.Module):
    """``forward(name, batch, batch_idx, ...)`` → ``module.<name>(batch, batch_idx, ...)``.

    ``autocast``, when given, is entered inside ``forward``: autocast state is thread-local
    and DataParallel runs each replica in its own thread.
    """

    def __init__(self, module: torch.nn.Module, autocast: Callable[[], Any] | None = None):
        super().__init__()
        self.module = module
        self.autocast = autocast

    def forward(self, name: str, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        step = getattr(self.module, name)
        if self.autocast is None:
            return step(batch, batch_idx, *args, **kwargs)
        with self.autocast():
            return step(batch, batch_idx, *args, **kwargs)


def reduce_replica_outputs(output: Any) -> Any:
    """Average what DataParallel replicas returned (gathered along dimension 0)."""
    if isinstance(output, torch.Tensor):
        return output.float().mean() if output.dim() else output
    if isinstance(output, dict):
        return {k: reduce_replica_outputs(v) for k, v in output.items()}
    return output


def data_parallel_step(
    parallel: torch.nn.Module, model: torch.nn.Module, name: str
) -> Callable[..., Any]:
    """A step function running ``name`` in DataParallel replicas, reduced like Lightning 1.0.

    A model's ``<name>_end(outputs)`` (e.g. ``training_step_end``) receives the gathered
    outputs; without one every gathered tensor is averaged over the replicas.
    """
    reduce_end = getattr(model, f"{name}_end", None)

    def step(batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        output = parallel(name, batch, batch_idx, *args, **kwargs)
        if callable(reduce_end):
            return reduce_end(output)
        return reduce_replica_outputs(output)

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
