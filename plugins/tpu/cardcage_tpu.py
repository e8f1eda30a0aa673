"""The tpu backend: torch-xla on TPU cores (or XLA's CPU device with ``PJRT_DEVICE=CPU``).

Discovery never imports torch_xla: ``availability`` looks for it (and checks that its version
matches torch's) before importing it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import cardcage
from cardcage import Accelerator, Availability, Resolution, Rule, SelectionContext
from cardcage.errors import MisconfigurationError

INSTALL = "pip install 'cardcage[tpu]' (torch-xla needs the torch release of the same version)"


def _release(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


class TPUAccelerator(Accelerator):
    name = "tpu"
    multi_node = False
    uses_tpu_cores = True
    rules = (
        Rule(
            order=200,
            when=lambda ctx: ctx.tpu_cores is not None,
            why="tpu_cores is set",
            name="tpu_cores",
        ),
    )

    @classmethod
    def availability(cls, ctx: SelectionContext) -> Availability:
        if importlib.util.find_spec("torch_xla") is None:
            return Availability(False, "torch_xla is not installed", INSTALL)
        xla_version = importlib.metadata.version("torch-xla")
        torch_version = importlib.metadata.version("torch")
        if _release(xla_version) != _release(torch_version):
            return Availability(
                False,
                f"torch-xla {xla_version} needs torch {'.'.join(_release(xla_version))}"
                f".*, but torch {torch_version} is installed",
                INSTALL,
            )
        try:
            import torch_xla.runtime as xr

            device = xr.device_type()
        except Exception as error:
            return Availability(
                False,
                f"no XLA device ({error})",
                "set PJRT_DEVICE=TPU on a TPU VM, or PJRT_DEVICE=CPU",
            )
        if not device:
            return Availability(
                False,
                "no XLA device (PJRT_DEVICE is not set)",
                "set PJRT_DEVICE=TPU on a TPU VM, or PJRT_DEVICE=CPU",
            )
        return Availability(True, f"XLA device type {device}")

    @classmethod
    def resolve(cls, ctx: SelectionContext) -> Resolution:
        if ctx.tpu_cores is None:
            raise MisconfigurationError(
                "distributed_backend='tpu' needs tpu_cores, which is unset. Set tpu_cores=1 "
                "(one core), 8 (all cores), or [k] (core k)."
            )
        return super().resolve(ctx)

    @classmethod
    def processes_per_node(cls, ctx: SelectionContext) -> int:
        return ctx.tpu_cores if isinstance(ctx.tpu_cores, int) else 1


@cardcage.hookimpl
def cardcage_accelerators() -> list[type[Accelerator]]:
    return [TPUAccelerator]
