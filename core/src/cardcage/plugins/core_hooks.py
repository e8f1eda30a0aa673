"""The core's own implementations of the lifecycle hooks; they run after every plugin's.

In the process that called ``fit``: ``cardcage_setup`` then ``cardcage_train``, once each.
In every training process: ``cardcage_setup_process`` once before the optimizers exist, and
``cardcage_teardown_process`` once when training ends, also after a failure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cardcage.plugins.spec import hookimpl

if TYPE_CHECKING:
    from cardcage.backend.accelerator import Accelerator
    from cardcage.backend.trainer_protocol import TrainerProtocol as Trainer


@hookimpl(trylast=True)
def cardcage_setup(trainer: Trainer, accelerator: Accelerator) -> bool:
    accelerator.setup(trainer)
    return True


@hookimpl(trylast=True)
def cardcage_train(trainer: Trainer, accelerator: Accelerator) -> object:
    return accelerator.train(trainer)


@hookimpl(trylast=True)
def cardcage_setup_process(trainer: Trainer, accelerator: Accelerator) -> bool:
    accelerator.setup_process(trainer)
    return True


@hookimpl(trylast=True)
def cardcage_teardown_process(trainer: Trainer, accelerator: Accelerator) -> bool:
    accelerator.teardown(trainer)
    return True
