"""What a backend, a launcher and the loop see of the Trainer during a fit.

:class:`TrainerProtocol` is the part of :class:`cardcage.Trainer` that the layers below it
use. Typing against it keeps those layers from importing the Trainer (which imports them),
so the core's modules import only downwards. A plugin's overrides of the Strategy and
Launcher methods take it too (``cardcage.sdk.TrainerProtocol``): annotated with the concrete
``cardcage.sdk.Trainer``, an override narrows its argument, which mypy rejects.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from cardcage.backend.selection_types import Selection
    from cardcage.checkpoints.io import Run
    from cardcage.config.flags import Flags
    from cardcage.config.model_contract import Optimization


class ProcessPlace(Protocol):
    """This process's place in the job, as its backend holds it."""

    @property
    def global_rank(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def is_global_zero(self) -> bool: ...
    @property
    def node_rank(self) -> int: ...
    @property
    def hands_back_results(self) -> bool: ...


class TrainerProtocol(Protocol):
    """The Trainer as the core's lower layers see it (see the module docstring)."""

    model: torch.nn.Module
    optimization: Optimization
    train_dataloader: Any
    val_dataloaders: list[Any]
    current_epoch: int
    global_step: int
    restarts: int
    restart_from: str | None
    run: Run | None
    batch_idx: int
    epoch_rng: dict[str, Any] | None
    in_epoch: bool
    stop_at_step: int
    logged_metrics: dict[str, float]

    @property
    def flags(self) -> Flags: ...
    @property
    def selection(self) -> Selection: ...
    @property
    def accelerator(self) -> ProcessPlace: ...

    def run_fit_loop(self) -> Any:
        """The job's work in this training process: the Trainer's fit loop, or the function
        a :class:`cardcage.Cage` launches. Launchers call it once in every training process."""

    def pickled_parts(self) -> dict[str, Any]:
        """The job's parts a worker launcher pickles, by label (``model``,
        ``train_dataloader``...; a Cage's ``fn`` and arguments), for its message when one
        cannot be pickled."""

    def attach(self) -> None: ...
    def checkpoint_state(self) -> dict[str, Any] | None: ...
    def loop_state(self) -> dict[str, Any]: ...
    def load_callback_states(self, states: dict[str, Any] | None) -> None: ...
    def save_checkpoint(self, path: str | os.PathLike[str]) -> None: ...
    def export_results(self) -> dict[str, Any] | None: ...
    def apply_results(self, result: dict[str, Any]) -> None: ...
    def at_stop_step(self) -> None: ...
    def resume_position(self) -> tuple[int, dict[str, Any] | None, bool]: ...
    def record_losses(self, losses: list[torch.Tensor]) -> None: ...
