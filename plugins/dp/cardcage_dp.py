"""The dp backend: one process, ``torch.nn.DataParallel`` across the GPUs of one node.

Each step's batch is split across the GPUs; every replica runs the model's step function and
the outputs are gathered on the root GPU. As in Lightning 1.0, a model may reduce them
itself with ``training_step_end(outputs)`` (``validation_step_end``, ``test_step_end``);
otherwise each replica's loss and logged scalars count by its share of the batch (a batch of
3 on 2 GPUs splits 2 + 1), so a step equals the plain loop's on the whole batch.

16-bit precision works: autocast is entered inside each replica (autocast state is
thread-local and DataParallel runs replicas in threads), and one GradScaler scales the
gathered loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cardcage.sdk import (
    Accelerator,
    Availability,
    SelectionContext,
    StepRunner,
    cuda_availability,
    data_parallel_step,
    gpu_memory_metrics,
    hookimpl,
)


class DataParallelAccelerator(Accelerator):
    name = "dp"
    multi_node = False
    needs_gpus = True
    rules = ()  # DataParallel is only ever chosen by name

    @classmethod
    def availability(cls, ctx: SelectionContext) -> Availability:
        return cuda_availability(ctx)

    @classmethod
    def processes_per_node(cls, ctx: SelectionContext) -> int:
        return 1

    def setup_environment(self) -> None:
        gpu_ids = self.selection.gpu_ids
        assert gpu_ids, "selection gave the dp backend no GPU"
        torch.cuda.set_device(gpu_ids[0])
        self.device = torch.device("cuda", gpu_ids[0])
        super().setup_environment()
        self.precision.check_device()
        # Batches go to the root GPU, where DataParallel gathers the outputs: a loss computed
        # outside the model (a Cage user's loop) finds its targets there. DataParallel
        # scatters the inputs from there to the replicas (as ddp2 on GPUs does).
        self.moves_batches = True

    def setup_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model on the root GPU, run in DataParallel replicas across the others.

        A Cage calls what this returns as ``wrapper(CALL, *args, **kwargs)``: DataParallel
        scatters every tensor in ``args`` and ``kwargs`` along dimension 0 and copies the
        rest (the name) to each replica, whose :class:`StepRunner` calls the model on its
        chunk; the outputs are gathered on the root GPU."""
        model.to(self.device)
        model = super().setup_module(model)
        return torch.nn.DataParallel(
            StepRunner(model, self.precision.autocast), device_ids=self.selection.gpu_ids
        )

    def step_function(self, model: torch.nn.Module, name: str) -> Callable[..., Any]:
        assert self.parallel is not None, "setup_process wraps the model first"
        return data_parallel_step(self.parallel, model, name)

    def on_epoch_end(self, trainer: Any) -> None:
        metrics = gpu_memory_metrics(trainer.flags.log_gpu_memory, self.selection.gpu_ids)
        trainer.logged_metrics.update(metrics)


@hookimpl
def cardcage_accelerators() -> list[type[Accelerator]]:
    return [DataParallelAccelerator]
