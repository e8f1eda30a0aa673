"""Numerical precision: autocast and the grad scaler, for ``precision`` 32, 16, ``"bf16"``, 64."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from cardcage.errors import MisconfigurationError


class Autocast:
    """A ``torch.autocast`` context factory for one device type and dtype. A class, not a
    lambda: spawning backends pickle the strategy that holds it to their workers."""

    def __init__(self, device_type: str, dtype: torch.dtype):
        self.device_type = device_type
        self.dtype = dtype

    def __call__(self) -> contextlib.AbstractContextManager[Any]:
        return torch.autocast(self.device_type, dtype=self.dtype)


class Precision:
    """What a backend needs to train at a precision on one device type.

    ``autocast`` is ``None`` at 32 and 64 (the loop then enters no context at all);
    ``scaler`` is a ``torch.amp.GradScaler`` at 16, else ``None``; ``dtype`` is the dtype the
    model and floating batches are cast to (64 only).
    """

    def __init__(self, precision: int | str, device_type: str):
        self.precision = precision
        self.device_type = device_type
        self.autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
        self.scaler: torch.amp.GradScaler | None = None
        self.dtype: torch.dtype | None = None
        if precision == 16:
            if device_type != "cuda":
                raise MisconfigurationError(
                    f"precision=16 (float16 autocast with a grad scaler) needs a CUDA GPU, but "
                    f"this run trains on {device_type}. Use precision='bf16' there, or gpus."
                )
            self.autocast = Autocast("cuda", torch.float16)
            self.scaler = torch.amp.GradScaler("cuda")
        elif precision == "bf16":
            self.autocast = Autocast(device_type, torch.bfloat16)
        elif precision == 64:
            self.dtype = torch.float64

    def check_device(self) -> None:
        """Refuse bf16 on a GPU that cannot do it (asks CUDA, so call it when training starts)."""
        if (
            self.precision == "bf16"
            and self.device_type == "cuda"
            and not (torch.cuda.is_bf16_supported())
        ):
            raise MisconfigurationError(
                "precision='bf16' is not supported by this GPU (torch.cuda.is_bf16_supported() "
                "is False). Use precision=16 or 32."
            )

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
        else:
            loss.backward()  # type: ignore[no-untyped-call]

    def unscale(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Divide the gradients by the loss scale (precision 16) before code reads them.

        The loop calls it before a model's ``on_after_backward``, so that clipping there works
        on true gradients; ``step`` then does not unscale again.
        """
        if self.scaler is not None:
            for optimizer in optimizers:
                self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.step(optimizer)
        else:
            optimizer.step()

    def update(self) -> None:
        """Once per training step, after every optimizer stepped."""
        if self.scaler is not None:
            self.scaler.update()

    def state_dict(self) -> dict[str, Any] | None:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
