"""The ddp_spawn backend: DistributedDataParallel in processes started by torch.multiprocessing.

Aliases: ``spawn``, and ``ddp_cpu``, which forces the CPU. It claims jobs with several GPUs
(Lightning 1.0's default, with its warning) and CPU jobs with ``num_processes > 1``. Where a
cluster already created the processes it runs as ``ddp`` in them.
"""

from __future__ import annotations

import pickle
import shutil
from typing import Any

import torch
import torch.distributed as dist

import cardcage
from cardcage import Accelerator, Availability, Resolution, Rule, SelectionContext, launch
from cardcage.accelerator import distributed_availability
from cardcage.distributed import DistributedAccelerator
from cardcage.errors import MisconfigurationError

MULTI_GPU_WARNING = (
    "You requested multiple GPUs but did not specify a backend, e.g. "
    'Trainer(distributed_backend="dp"|"ddp"|"ddp2"). Setting distributed_backend="ddp_spawn" '
    "for you."
)


class DDPSpawnAccelerator(DistributedAccelerator):
    name = "ddp_spawn"
    aliases = ("spawn", "ddp_cpu")
    rules = (
        Rule(
            order=400,
            when=lambda ctx: ctx.num_gpus > 1,
            why="more than one GPU",
            name="multi_gpu",
            warning=MULTI_GPU_WARNING,
        ),
        Rule(
            order=500,
            when=lambda ctx: ctx.num_gpus == 0 and ctx.num_processes > 1,
            why="no GPU and num_processes > 1",
            name="cpu_processes",
        ),
    )

    @classmethod
    def availability(cls, ctx: SelectionContext) -> Availability:
        return distributed_availability()

    @classmethod
    def resolve(cls, ctx: SelectionContext) -> Resolution:
        resolution = super().resolve(ctx)
        notes = []
        drop = ctx.requested_as == "ddp_cpu" and bool(ctx.gpu_ids)
        if drop:
            notes.append(
                "You requested one or more GPUs, but set the backend to `ddp_cpu`. "
                "Training will not use GPUs."
            )
        target = resolution.accelerator
        if ctx.processes_created_outside:
            target = "ddp"
            notes.append(
                f"the {ctx.cluster.name} environment already created the processes, so "
                f"distributed_backend={ctx.requested_as!r} runs as 'ddp' in them."
            )
        return Resolution(target, " ".join(notes) or resolution.warning, drop_gpus=drop)

    def train(self, trainer: Any) -> Any:
        """Spawn one worker per local rank; rank 0's weights and results come back here."""
        selection = self.selection
        payload = pickled(trainer)
        folder = launch.spawn(
            _worker,
            selection.num_processes,
            (payload,),
            node_rank=selection.node_rank,
            num_nodes=selection.num_nodes,
            master_address=selection.master_address or launch.DEFAULT_ADDRESS,
            master_port=selection.master_port,
        )
        try:
            path = folder / f"result-node{selection.node_rank}.pt"
            result = torch.load(path, weights_only=True)
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # fit leaves no file behind
        trainer.model.load_state_dict(result.pop("state_dict"))
        trainer.apply_results(result)
        return None


def pickled(trainer: Any) -> bytes:
    """The trainer (model and loaders included) as plain pickle bytes for the workers.

    Plain pickle copies tensors; torch.multiprocessing's pickler would instead share their
    memory between the workers, so that every rank's optimizer step would land on the same
    weights. Anything that cannot be pickled is refused here, by name, before any spawn.
    """
    try:
        return pickle.dumps(trainer)
    except Exception:
        check_picklable(trainer)
        raise


def check_picklable(trainer: Any) -> None:
    """Name the part of the job that cannot be pickled."""
    parts = {"model": trainer.model, "train_dataloader": trainer.train_dataloader}
    parts.update({f"val_dataloaders[{i}]": v for i, v in enumerate(trainer.val_dataloaders)})
    for label, value in parts.items():
        try:
            pickle.dumps(value)
        except Exception as error:
            raise MisconfigurationError(
                f"distributed_backend='ddp_spawn' sends the {label} to its worker processes "
                f"by pickling, but it cannot be pickled ({type(error).__name__}: {error}). "
                "Make it picklable (no lambdas or local classes), or use "
                "distributed_backend='ddp', which re-runs your script instead."
            ) from None


def _worker(local_rank: int, rank_env: dict[str, str], payload: bytes) -> None:
    """One spawned rank: train, and on the node's local rank 0 leave the results."""
    launch.spawned_worker_start(rank_env)
    try:
        trainer = pickle.loads(payload)
        trainer.attach()
        trainer.run_fit_loop()
        if local_rank == 0:
            state = trainer.export_results()
            torch.save(state, launch.result_path())
    except BaseException as error:
        launch.write_error_file(error)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@cardcage.hookimpl
def cardcage_accelerators() -> list[type[Accelerator]]:
    return [DDPSpawnAccelerator]
