"""The training loop's step losses: kept on the device, read where the backend has run
them, and checked for NaN or infinite values (``terminate_on_nan``)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from cardcage.errors import NonFiniteLossError

if TYPE_CHECKING:
    from cardcage.backend.strategy.strategy import Strategy
    from cardcage.backend.trainer_protocol import TrainerProtocol as Trainer

LOSS_CHUNK = 64


def _place(trainer: Trainer, global_step: int, batch_idx: int) -> str:
    """``global_step=N (epoch E, batch_idx=B)``, and the rank when there are several."""
    rank = trainer.accelerator
    on = f" on rank {rank.global_rank}" if rank.world_size > 1 else ""
    return f"global_step={global_step} (epoch {trainer.current_epoch}, batch_idx={batch_idx}){on}"


def stop_on_nan(
    trainer: Trainer, accelerator: Strategy, loss: torch.Tensor, batch_idx: int
) -> None:
    """``terminate_on_nan=True``: raise when this step's loss is NaN or infinite, before its
    backward and optimizer step. Reading it (``Strategy.read``) is one device sync a step."""
    read = accelerator.read(loss)
    if bool(torch.isfinite(read).all()):
        return
    value = float(read.reshape(-1)[0])
    place = _place(trainer, trainer.global_step, batch_idx)
    raise NonFiniteLossError(
        f"training_step returned a loss of {value} at {place}; terminate_on_nan=True stopped "
        "training there, before that step's backward and optimizer step (the weights are those "
        "of the step before). Look for a learning rate too high, a log or division of zero, "
        "float16 overflow (try precision=32 or 'bf16') or bad values in that batch.",
        global_step=trainer.global_step,
        epoch=trainer.current_epoch,
        batch_idx=batch_idx,
        value=value,
    )


class Losses:
    """A fit's step losses: on the device in chunks of ``LOSS_CHUNK`` (thousands of tiny
    tensors fragment memory), copied to the CPU and checked for NaN once the backend has run
    them: after the next batch arrived, or after ``on_epoch_end``. On a lazy engine (XLA) a
    step's values exist only after its step barrier; reading them before would make each
    replica thread run a program of its own at once, outside the barrier's turns, and that
    crashes XLA:CPU (a segfault in 1 of 2 runs of the kit's job).

    On the CPU a loss is read at once (:attr:`keep` is ``Tensor.item``: no sync to wait
    for, and nothing kept alive). Keeping 64 detached one-value tensors alive there cost
    16,000 instructions a step, most of them in ``malloc`` working around the small blocks
    they pinned: more than the rest of the loop's bookkeeping together."""

    def __init__(self, trainer: Trainer, watch_nan: bool, device: torch.device) -> None:
        self.trainer = trainer
        self.watch_nan = watch_nan  # until the first warning of this fit
        self._floats = device.type == "cpu"
        #: What the loop keeps of each step's loss in :attr:`pending`.
        self.keep: Callable[[torch.Tensor], Any] = (
            torch.Tensor.item if self._floats else torch.Tensor.detach
        )
        self.pending: list[Any] = []  # floats on the CPU, detached tensors elsewhere
        self.unread: list[tuple[torch.Tensor, int, int]] = []  # chunk, its last step and batch
        self.read: list[torch.Tensor] = []

    def close_chunk(self, last_step: int, last_batch: int) -> None:
        if self.pending:
            if self._floats:
                chunk = torch.tensor(self.pending, dtype=torch.float64)
            else:
                chunk = torch.stack(self.pending).reshape(-1)
            self.unread.append((chunk, last_step, last_batch))
            self.pending.clear()  # in place: the loop holds this list

    def read_chunks(self) -> None:
        """Copy the chunks the backend has run to the CPU (one transfer each), warning at the
        first NaN or infinite loss."""
        for chunk, last_step, last_batch in self.unread:
            values = chunk.cpu()
            if self.watch_nan and _warn_non_finite(self.trainer, values, last_step, last_batch):
                self.watch_nan = False
            self.read.append(values)
        self.unread.clear()

    def epoch(self) -> list[torch.Tensor]:
        """This epoch's losses, read, as 1-D chunks; the next epoch starts empty."""
        self.read_chunks()
        chunks, self.read = self.read, []
        return chunks


def _warn_non_finite(
    trainer: Trainer, chunk: torch.Tensor, last_step: int, last_batch: int
) -> bool:
    """Whether ``chunk`` (the losses of consecutive steps on the CPU, the last of them
    ``last_step``) holds a NaN or infinite loss; if so, warn naming the first."""
    finite = torch.isfinite(chunk)
    if bool(finite.all()):
        return False
    index = int((~finite).nonzero()[0, 0])
    back = chunk.numel() - 1 - index
    place = _place(trainer, last_step - back, last_batch - back)
    warnings.warn(
        f"cardcage: training_step returned a loss of {float(chunk[index])} at {place}. "
        "Training goes on (terminate_on_nan=False) and this warning is not repeated in this "
        "fit. Set Trainer(terminate_on_nan=True) to stop at the first NaN or infinite loss.",
        RuntimeWarning,
        stacklevel=2,
    )
    return True
