"""``trainer.predict``: a model's predictions over loaders, every sample once, in order."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from cardcage.train.trainer import Trainer


def predict(trainer: Trainer, model: torch.nn.Module | None, dataloaders: Any) -> list[Any]:
    raise NotImplementedError("trainer.predict is being built")
