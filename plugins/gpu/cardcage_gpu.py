"""The gpu backend: one process on one CUDA GPU (the root GPU of the ``gpus`` flag)."""

from __future__ import annotations

from typing import Any

import torch

from cardcage.sdk import (
    Accelerator,
    Availability,
    Resolution,
    Rule,
    SelectionContext,
    cuda_availability,
    gpu_memory_metrics,
    hookimpl,
)


class GPUAccelerator(Accelerator):
    name = "gpu"
    multi_node = False
    needs_gpus = True
    rules = (
        Rule(
            order=600, when=lambda ctx: ctx.num_gpus == 1, why="exactly one GPU", name="single_gpu"
        ),
    )

    @classmethod
    def availability(cls, ctx: SelectionContext) -> Availability:
        return cuda_availability(ctx)

    @classmethod
    def resolve(cls, ctx: SelectionContext) -> Resolution:
        resolution = super().resolve(ctx)
        if resolution.accelerator == cls.name and ctx.gpu_ids and ctx.num_gpus > 1:
            return Resolution(
                cls.name,
                f"distributed_backend='gpu' trains on one GPU (GPU {ctx.gpu_ids[0]}), but "
                f"gpus={ctx.flags.gpus!r} asks for {ctx.num_gpus}. Use 'ddp' or 'dp' to "
                "train on all of them.",
            )
        return resolution

    @classmethod
    def processes_per_node(cls, ctx: SelectionContext) -> int:
        return 1

    def setup_environment(self) -> None:
        root = self.selection.root_gpu
        assert root is not None, "selection gave the gpu backend no GPU"
        torch.cuda.set_device(root)
        self.device = torch.device("cuda", root)
        super().setup_environment()  # precision for the device type
        self.precision.check_device()
        self.moves_batches = True

    def setup_module(self, model: torch.nn.Module) -> torch.nn.Module:
        model.to(self.device)
        return super().setup_module(model)  # the float64 cast

    def on_epoch_end(self, trainer: Any) -> None:
        metrics = gpu_memory_metrics(trainer.flags.log_gpu_memory, self.selection.gpu_ids)
        trainer.logged_metrics.update(metrics)


@hookimpl
def cardcage_accelerators() -> list[type[Accelerator]]:
    return [GPUAccelerator]
