"""``cardcage.Module``: the optional base class that gives a model ``self.log`` and the
trainer's counters, as Lightning 1.0's ``LightningModule`` did. A plain ``nn.Module`` with the
same hooks trains the same; only these conveniences need the base class."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from cardcage.errors import MisconfigurationError

if TYPE_CHECKING:
    from cardcage.train.trainer import Trainer

#: The attribute the loop sets on the model that trains, in each training process.
TRAINER_ATTRIBUTE = "_cardcage_trainer"
#: The names the loop writes with every row itself: ``self.log`` refuses them.
RESERVED_NAMES = ("step", "epoch")


class Module(torch.nn.Module):
    """A ``torch.nn.Module`` with ``self.log``, ``self.log_dict``, ``self.trainer``,
    ``self.current_epoch``, ``self.global_step``, ``self.global_rank``, ``self.device`` and
    ``self.print``. The hooks (docs/training-loop.md) are plain methods: define those you
    need."""

    _cardcage_trainer: Trainer | None = None

    @property
    def trainer(self) -> Trainer | None:
        """The Trainer fitting this model in this process; None outside a fit."""
        return self.__dict__.get(TRAINER_ATTRIBUTE)

    @property
    def current_epoch(self) -> int:
        trainer = self.trainer
        return trainer.current_epoch if trainer is not None else 0

    @property
    def global_step(self) -> int:
        trainer = self.trainer
        return trainer.global_step if trainer is not None else 0

    @property
    def global_rank(self) -> int:
        trainer = self.trainer
        return trainer.global_rank if trainer is not None else 0

    @property
    def device(self) -> torch.device:
        """Where the model's first parameter (or buffer) is; the CPU when it has none."""
        for parameter in self.parameters():
            return parameter.device
        for buffer in self.buffers():
            return buffer.device
        return torch.device("cpu")

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only."""
        if self.global_rank == 0:
            print(*args, **kwargs)

    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool = True,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: str = "mean",
        sync_dist: bool = False,
        batch_size: int | None = None,
    ) -> None:
        """Record a scalar metric (Lightning 1.0's defaults: in training steps
        ``on_step=True, on_epoch=False``, in validation and test steps and in epoch-end
        hooks the reverse). Epoch values are means weighted by batch size; ``sync_dist``
        reduces across ranks. See docs/training-loop.md, "Logging"."""
        if name in RESERVED_NAMES:
            raise MisconfigurationError(
                f"self.log({name!r}, ...): {name!r} is the name of the column the loop "
                f"writes each row's {name} into (every logger gets it with the metrics), and "
                "logging it would overwrite that column. Log it under another name, e.g. "
                f"self.log('my_{name}', ...)."
            )
        trainer = self.trainer
        if trainer is None:
            _warn_outside_fit(name)
            return
        trainer.metrics.log(
            name,
            value,
            prog_bar=prog_bar,
            logger=logger,
            on_step=on_step,
            on_epoch=on_epoch,
            reduce_fx=reduce_fx,
            sync_dist=sync_dist,
            batch_size=batch_size,
        )

    def log_dict(
        self,
        dictionary: Mapping[str, Any],
        prog_bar: bool = False,
        logger: bool = True,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: str = "mean",
        sync_dist: bool = False,
        batch_size: int | None = None,
    ) -> None:
        """``self.log`` for each item of ``dictionary``, with the same options."""
        for name, value in dictionary.items():
            self.log(
                name,
                value,
                prog_bar=prog_bar,
                logger=logger,
                on_step=on_step,
                on_epoch=on_epoch,
                reduce_fx=reduce_fx,
                sync_dist=sync_dist,
                batch_size=batch_size,
            )

    def __getstate__(self) -> dict[str, Any]:
        # A model travels to spawned workers without the caller's trainer (each worker's
        # loop sets its own).
        state: dict[str, Any] = super().__getstate__()  # type: ignore[no-untyped-call]
        state.pop(TRAINER_ATTRIBUTE, None)
        return state


_warned_outside: set[str] = set()


def _warn_outside_fit(name: str) -> None:
    if name not in _warned_outside:
        _warned_outside.add(name)
        warnings.warn(
            f"cardcage: self.log({name!r}, ...) was called outside trainer.fit, validate and "
            "test, where no trainer records it: the value is dropped.",
            UserWarning,
            stacklevel=3,
        )
