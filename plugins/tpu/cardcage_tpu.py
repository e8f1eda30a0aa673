"""The tpu backend: torch-xla on TPU cores, or on XLA's CPU device with ``PJRT_DEVICE=CPU``.

``tpu_cores`` keeps Lightning 1.0's three meanings on the PJRT runtime: ``1`` trains in this
process on ``xla:0`` (set up by ``xmp.spawn(fn, nprocs=1)``), ``[k]`` in this process on core
k (PJRT's ``xla:{k-1}``), ``8`` a replica on every XLA device of the host (``xmp.spawn``),
rank 0's state coming back. On XLA's CPU device the replicas are threads of one process that
compile in turn (the README says why). Discovery never imports torch_xla, and
``availability`` never starts XLA's runtime.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Any, TypeVar

import torch

from cardcage.sdk import (
    Accelerator,
    Availability,
    EngineStrategy,
    InProcessLauncher,
    Launcher,
    MisconfigurationError,
    Rule,
    SelectionContext,
    TrainerProtocol,
    WorkerLauncher,
    environ,
    hookimpl,
    matching_torch_release,
    run_worker,
)

log = logging.getLogger("cardcage")
T = TypeVar("T")

# The pair of the `engine` extra (pyproject.toml): torch-xla works with its own torch alone.
INSTALL = (
    "pip install torch==2.9.0 torch-xla==2.9.0, the pair that works together, as "
    "pip install 'cardcage-tpu[engine]' installs it; on a TPU VM, torch-xla[tpu]==2.9.0 adds "
    "the TPU runtime"
)
NO_DEVICE_HINT = (
    "on a TPU VM install torch-xla with its TPU runtime (pip install 'torch-xla[tpu]'); "
    "elsewhere set PJRT_DEVICE=CPU to train on XLA's CPU device"
)
# Imported without this, torch_xla writes PJRT_DEVICE (TPU when it finds one, else CPU):
# availability must not change the environment it judges. _choose_device_type decides.
NO_DEFAULT_DEVICE = {"PJRT_SELECT_DEFAULT_DEVICE": "0"}


def _tpu_chips() -> int:
    """TPU chips attached to this host (0 without libtpu); starts no runtime."""
    import torch_xla
    from torch_xla._internal import tpu

    if not getattr(torch_xla, "_found_libtpu", False):
        return 0
    return int(tpu.num_available_chips())


def _choose_device_type() -> str:
    """``PJRT_DEVICE`` for this process, where training starts: as set, else TPU when one is
    attached; an error otherwise (availability said so)."""
    chosen = os.environ.get("PJRT_DEVICE")
    if chosen:
        return chosen.split("_")[0]
    if _tpu_chips() > 0:
        os.environ["PJRT_DEVICE"] = "TPU"
        return "TPU"
    raise MisconfigurationError(
        f"distributed_backend='tpu' found no TPU and PJRT_DEVICE is not set: {NO_DEVICE_HINT}."
    )


class TPUAccelerator(EngineStrategy, Accelerator):
    name = "tpu"
    multi_node = False
    uses_tpu_cores = True
    moves_batches = True  # batches of validate()/test() outside fit; fit's arrive on the device
    rules = (
        Rule(
            order=200,
            when=lambda ctx: ctx.tpu_cores is not None,
            why="tpu_cores is set",
            name="tpu_cores",
        ),
    )

    # -- selection (with the core's defaults for uses_tpu_cores) ----------------------------

    @classmethod
    def availability(cls, ctx: SelectionContext) -> Availability:
        if importlib.util.find_spec("torch_xla") is None:
            return Availability(False, "torch_xla is not installed", INSTALL)
        release = matching_torch_release("torch-xla", INSTALL)
        if not release:
            return release
        try:
            with environ(NO_DEFAULT_DEVICE, override=True):
                import torch_xla  # noqa: F401

            chips = _tpu_chips()
        except Exception as error:
            version = importlib.metadata.version("torch-xla")
            return Availability(False, f"torch_xla {version} fails to import ({error})", INSTALL)
        pjrt_device = ctx.env.get("PJRT_DEVICE")
        if pjrt_device:
            return Availability(True, f"XLA device type {pjrt_device.split('_')[0]} (PJRT_DEVICE)")
        if chips:
            return Availability(True, f"{chips} TPU chip(s)")
        return Availability(False, "no TPU found and PJRT_DEVICE is not set", NO_DEVICE_HINT)

    # -- where this process trains ---------------------------------------------------------

    def __init__(self, selection: Any):
        super().__init__(selection)
        cores = selection.tpu_cores
        self.core = cores[0] - 1 if isinstance(cores, list) else None  # [k]: PJRT's xla:{k-1}
        self.multi_core = isinstance(cores, int) and cores > 1  # replicas from xmp.spawn
        self.replicated = False  # a replica of a multi-core job (its collectives are live)
        #: ids of the optimizers whose gradients clip_gradients averaged for the next step.
        self.reduced: set[int] = set()
        #: Backward passes in this process, and that count at each optimizer's last step (by
        #: id): more than one in between accumulates gradients (see reduce_gradients).
        self.backwards = 0
        self.stepped_at: dict[int, int] = {}

    def setup_environment(self) -> None:
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        if self.replicated:
            self.device = torch_xla.device()
            self.global_rank = xr.global_ordinal()
            self.local_rank = xr.local_ordinal()
            self.world_size = xr.world_size()
            self.threads = xr.addressable_device_count()  # threads on XLA:CPU and v2/v3 TPUs
            if self.global_rank == 0 and self.world_size != self.selection.tpu_cores:
                log.warning(
                    "cardcage: tpu_cores=%s trains on every XLA device of this host: %d "
                    "replica(s) here",
                    self.selection.tpu_cores,
                    self.world_size,
                )
        else:
            _choose_device_type()
            devices = xm.get_xla_supported_devices()
            index = self.core
            if index is not None and index >= len(devices):
                raise MisconfigurationError(
                    f"tpu_cores={self.selection.flags.tpu_cores!r} names core {index + 1} "
                    f"(device xla:{index}), but this host's XLA runtime has {len(devices)} "
                    f"device(s): {', '.join(devices)}. Name a core in 1..{len(devices)}."
                )
            self.device = torch_xla.device(index)
            self.global_rank = self.local_rank = 0
            self.world_size = 1
        super().setup_environment()
        self.moves_batches = True

    def setup_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model on this replica's device, with rank 0's parameters and buffers (as
        DistributedDataParallel starts): each replica of a Cage builds its own model, and
        replicas that are threads of one process share torch's random generator."""
        model.to(self.device)
        model = super().setup_module(model)
        if self.collectives_live:
            self.broadcast_state(model)
        return model

    def broadcast_state(self, model: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers, in place on every replica, in one program."""
        import torch_xla.core.xla_model as xm

        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in (*model.parameters(), *model.buffers()):
            if tensor.dtype != torch.bool and not tensor.is_complex():
                by_dtype.setdefault(tensor.dtype, []).append(tensor)
        with torch.no_grad():
            for tensors in by_dtype.values():
                xm.collective_broadcast(tensors, root_ordinal=0)
        self.step_barrier()

    def setup_optimizers(self, trainer: TrainerProtocol) -> None:
        """Count each new optimizer's backward passes from here (see reduce_gradients)."""
        for optimizer in trainer.optimization.optimizers:
            self.stepped_at[id(optimizer)] = self.backwards

    def backward(self, loss: torch.Tensor) -> None:
        self.backwards += 1
        try:
            super().backward(loss)
        except RuntimeError as error:
            if "device_ready_queues_" not in str(error):
                raise
            raise MisconfigurationError(
                "this process ran a backward pass before XLA's runtime started, and PyTorch's "
                "autograd engine sized its device queues then, without the XLA devices. Train "
                "on XLA before anything else in the process runs backward (or first use an XLA "
                "device: torch_xla.device()), or train with tpu_cores in a fresh process."
            ) from error

    def clip_gradients(
        self, optimizer: torch.optim.Optimizer, value: float, algorithm: str
    ) -> torch.Tensor | None:
        """Average the gradients over the replicas first (which ``optimizer_step`` then does
        not repeat), then clip them as the default does: the norm is that of the averaged
        gradients, as in one process.

        Replicas that are threads of this process run the all-reduce first (the step
        barrier), so that reading the norm (a Cage's ``clip_gradients`` returns it) runs a
        program without collectives: a thread that ran one holding the all-reduce alone
        would wait for its peers forever (XLA:CPU's all-reduce meets only inside one
        compiled program, see :meth:`sync`)."""
        self.reduce_gradients(optimizer)
        self.reduced.add(id(optimizer))
        if self.threads > 1:
            self.step_barrier()
        return super().clip_gradients(optimizer, value, algorithm)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Average the gradients over the replicas (unless ``clip_gradients`` did), then step:
        ``xm.optimizer_step``'s work. Replicas that are threads of this process then run the
        step (the step barrier), for the reason :meth:`clip_gradients` gives: a user's loop
        may read the weights before the next batch."""
        if id(optimizer) in self.reduced:
            self.reduced.discard(id(optimizer))
        else:
            self.reduce_gradients(optimizer)
        optimizer.step()
        self.stepped_at[id(optimizer)] = self.backwards
        if self.threads > 1:
            self.step_barrier()

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """``xm.reduce_gradients``. When the gradients were accumulated over several backward
        passes since ``optimizer``'s last step (``accumulate_grad_batches > 1``, a Cage's
        ``no_backward_sync``, or two backward passes in a user's loop), each is first
        replaced by a copy: with torch-xla 2.9 on XLA:CPU (two replicas), the in-place
        all-reduce left gradients accumulated over several programs as they were (each
        replica stepped on its own sum; the kit's ``accumulate`` scenario shows it), and a
        copy is reduced."""
        import torch_xla.core.xla_model as xm

        if self.backwards - self.stepped_at.get(id(optimizer), 0) > 1:
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    if parameter.grad is not None:
                        parameter.grad = parameter.grad.clone()
        xm.reduce_gradients(optimizer)

    def portable(self, obj: T) -> T:
        """``obj`` with its XLA tensors on the CPU, moved as ``xm.save`` moves them: one
        batched transfer, after the graphs that produce them ran."""
        if self.device.type != "xla":
            return obj
        import torch_xla.core.xla_model as xm

        moved: T = xm._maybe_convert_to_cpu(obj)
        return moved

    def teardown(self, trainer: Any) -> None:
        import torch_xla.core.xla_model as xm

        if sys.exc_info()[0] is not None:
            return  # training failed here: the peers will never reach the step barrier
        self.step_barrier()
        xm.wait_device_ops()

    # -- the engine's primitives, for EngineStrategy (step barrier, loaders, collectives) --

    def sync(self) -> None:
        """Run the pending graph. Replica threads (``threads``) take turns at it: XLA:CPU's
        all-reduce meets only inside one compiled program (the README shows it)."""
        import torch_xla

        torch_xla.sync()

    def device_loader(self, loader: Any) -> Any:
        from torch_xla.distributed.parallel_loader import MpDeviceLoader

        return MpDeviceLoader(loader, self.device)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Also the barrier's (``xm.rendezvous`` would compile outside the replicas' turns)."""
        import torch_xla.core.xla_model as xm

        total: torch.Tensor = xm.all_reduce(xm.REDUCE_SUM, tensor)
        return total

    def broadcast_tensor(self, tensor: torch.Tensor, src: int) -> None:
        import torch_xla.core.xla_model as xm

        xm.collective_broadcast([tensor], root_ordinal=src)

    @property
    def collectives_live(self) -> bool:
        return self.replicated and self.world_size > 1

    # -- processes ------------------------------------------------------------------------

    def make_launcher(self) -> Launcher:
        """One core: this process (``[k]``), or ``xmp.spawn(fn, nprocs=1)`` here (``1``).
        Every core: the replicas from ``xmp.spawn``; rank 0's state comes back here."""
        if self.multi_core:
            return XmpLauncher(self)
        if self.core is None:
            return SingleCoreLauncher(self)
        return InProcessLauncher(self)


class SingleCoreLauncher(Launcher):
    """``tpu_cores=1``: ``xmp.spawn(fn, nprocs=1)``, which runs ``fn`` in this process after
    setting it up for one device (on a TPU, the runtime then takes a single chip)."""

    def launch(self, trainer: TrainerProtocol) -> Any:
        import torch_xla.distributed.xla_multiprocessing as xmp

        _choose_device_type()
        xmp.spawn(_fit_here, args=(trainer,), nprocs=1)
        return None


def _fit_here(index: int, trainer: TrainerProtocol) -> None:
    trainer.run_fit_loop()


class XmpLauncher(WorkerLauncher):
    """``tpu_cores=8``: a replica per XLA device of this host, from ``xmp.spawn``."""

    unpicklable_hint = "or train on one core (tpu_cores=1)"

    def describe(self, trainer: TrainerProtocol) -> str:
        return f"tpu_cores={trainer.flags.tpu_cores!r}"

    def start_workers(self, payload: bytes, folder: Path) -> None:
        import torch_xla
        import torch_xla.distributed.xla_multiprocessing as xmp

        if torch_xla._XLAC._xla_runtime_is_initialized():
            raise MisconfigurationError(
                f"tpu_cores={self.accelerator.selection.flags.tpu_cores!r} starts its replicas "
                "with xmp.spawn, which needs a process that has not used an XLA device yet, "
                "and this one has. Train on every core in a fresh process (before any "
                "tpu_cores=1 or [k] run), or on one core."
            )
        device_type = _choose_device_type()
        # XLA:CPU's asynchronous client dead-locks all-reduces between replica threads.
        settings = {"PJRT_CPU_ASYNC_CLIENT": "0"} if device_type == "CPU" else {}
        with environ(settings):
            xmp.spawn(_replica, args=(payload, str(folder)))


def _replica(index: int, payload: bytes, folder: str) -> None:
    """One replica of a multi-core job. It reports a failure at once (``failure_rank``): its
    peers wait for it in a collective, and XLA may end the process before the error surfaces."""
    import torch_xla.runtime as xr

    run_worker(payload, folder, before_fit=_mark_replicated, failure_rank=xr.global_ordinal)


def _mark_replicated(trainer: TrainerProtocol) -> None:
    trainer.accelerator.replicated = True  # type: ignore[attr-defined]


@hookimpl
def cardcage_accelerators() -> list[type[Accelerator]]:
    return [TPUAccelerator]
