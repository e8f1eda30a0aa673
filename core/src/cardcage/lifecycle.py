"""The core's own implementations of the lifecycle hooks; they run after every plugin's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cardcage.spec import hookimpl

if TYPE_CHECKING:
    from cardcage.accelerator import Accelerator
    from cardcage.trainer import Trainer


@hookimpl(trylast=True)
def cardcage_setup(trainer: Trainer, accelerator: Accelerator) -> bool:
    accelerator.setup(trainer)
    return True


@hookimpl(trylast=True)
def cardcage_train(trainer: Trainer, accelerator: Accelerator) -> object:
    return accelerator.train(trainer)
