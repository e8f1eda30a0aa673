"""The tpu backend: torch-xla on TPU cores, or on XLA's CPU device with ``PJRT_DEVICE=CPU``.

``tpu_cores`` keeps Lightning 1.0's three meanings on today's PJRT runtime: ``1`` trains in
this process on ``xla:0`` (set up by ``xmp.spawn(fn, nprocs=1)``); ``[k]`` trains in this
process on core k, PJRT's device ``xla:{k-1}``; ``8`` trains a replica on every XLA device of
this host (``xmp.spawn``) and takes rank 0's state back. On XLA's CPU device the replicas are
threads of one process, which compile one at a time and line up after every step (the
README says why). Discovery never imports torch_xla, and ``availability`` never starts XLA's
runtime.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import logging
import os
import pickle
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from cardcage.sdk import (
    Accelerator,
    Availability,
    InProcessLauncher,
    Launcher,
    MisconfigurationError,
    Resolution,
    Rule,
    SelectionContext,
    Trainer,
    WorkerLauncher,
    hookimpl,
    init_timeout,
    move_to,
    run_worker,
    write_error_file,
)

log = logging.getLogger("cardcage")
T = TypeVar("T")

INSTALL = (
    "pip install 'cardcage[tpu]', with the torch-xla release that matches torch's, for "
    "example pip install torch==2.9.0 torch-xla==2.9.0"
)
NO_DEVICE_HINT = (
    "on a TPU VM install torch-xla with its TPU runtime (pip install 'torch-xla[tpu]'); "
    "elsewhere set PJRT_DEVICE=CPU to train on XLA's CPU device"
)


def _release(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


@contextlib.contextmanager
def _no_default_device_choice() -> Iterator[None]:
    """Import torch_xla without letting it write ``PJRT_DEVICE`` into ``os.environ``.

    On import, torch_xla sets ``PJRT_DEVICE`` (TPU when it finds one, else CPU) unless the
    variable is set. Availability must not change the environment it is judging, so the
    choice is made later, by :func:`_choose_device_type`, when training starts.
    """
    key = "PJRT_SELECT_DEFAULT_DEVICE"
    previous = os.environ.get(key)
    os.environ[key] = "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous


def _tpu_chips() -> int:
    """TPU chips attached to this host (0 without libtpu); starts no runtime."""
    import torch_xla
    from torch_xla._internal import tpu

    if not getattr(torch_xla, "_found_libtpu", False):
        return 0
    return int(tpu.num_available_chips())


def _choose_device_type() -> str:
    """``PJRT_DEVICE`` for this process: as set, else TPU when one is attached.

    Called where training starts, before XLA's runtime is. Raises when neither holds, the
    case availability reports as unavailable.
    """
    chosen = os.environ.get("PJRT_DEVICE")
    if chosen:
        return chosen.split("_")[0]
    if _tpu_chips() > 0:
        os.environ["PJRT_DEVICE"] = "TPU"
        return "TPU"
    raise MisconfigurationError(
        f"distributed_backend='tpu' found no TPU and PJRT_DEVICE is not set: {NO_DEVICE_HINT}."
    )


def _to_cpu(obj: T) -> T:
    """``obj`` with its XLA tensors moved to the CPU (nested containers too), as ``xm.save``
    moves them: one batched transfer after the graphs that produce them ran."""
    import torch_xla.core.xla_model as xm

    moved: T = xm._maybe_convert_to_cpu(obj)
    return moved


def _holds_cpu_tensor(batch: Any) -> bool:
    if isinstance(batch, torch.Tensor):
        return batch.device.type == "cpu"
    if isinstance(batch, (list, tuple)):
        return any(_holds_cpu_tensor(item) for item in batch)
    if isinstance(batch, dict):
        return any(_holds_cpu_tensor(item) for item in batch.values())
    return False


_compile_turn = threading.Lock()  # one replica thread compiles at a time
_barriers: dict[int, threading.Barrier] = {}
_barriers_guard = threading.Lock()


def _thread_barrier(parties: int) -> threading.Barrier:
    """The barrier the ``parties`` replica threads of this process meet at after each step."""
    with _barriers_guard:
        barrier = _barriers.get(parties)
        if barrier is None or barrier.broken:
            barrier = threading.Barrier(parties, timeout=init_timeout())
            _barriers[parties] = barrier
        return barrier


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` added where unset, for the processes started inside."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


class DeviceLoader:
    """``MpDeviceLoader`` over a loader: batches arrive on the device, uploaded in the
    background, with the step barrier (``torch_xla.sync()``) at every batch. ``sampler`` is the
    wrapped loader's, so that a distributed sampler can be told the epoch."""

    def __init__(self, loader: Any, device: torch.device, step_barrier: Callable[[], None]):
        from torch_xla.distributed.parallel_loader import MpDeviceLoader

        self.loader = loader
        self.sampler = getattr(loader, "sampler", None)
        self.step_barrier = step_barrier
        self._device_loader = MpDeviceLoader(loader, device)

    def __iter__(self) -> Iterator[Any]:
        batches = iter(self._device_loader)
        while True:
            # MpDeviceLoader's own sync then finds nothing left to run; this one is the
            # replicas' turn-taking barrier (see TPUAccelerator.step_barrier).
            self.step_barrier()
            try:
                batch = next(batches)
            except StopIteration:
                return
            yield batch

    def __len__(self) -> int:
        return len(self.loader)


class TPUAccelerator(Accelerator):
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

    # -- selection ------------------------------------------------------------------------

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
            with _no_default_device_choice():
                import torch_xla  # noqa: F401

            chips = _tpu_chips()
        except Exception as error:
            return Availability(
                False, f"torch_xla {xla_version} fails to import ({error})", INSTALL
            )
        pjrt_device = ctx.env.get("PJRT_DEVICE")
        if pjrt_device:
            return Availability(True, f"XLA device type {pjrt_device.split('_')[0]} (PJRT_DEVICE)")
        if chips:
            return Availability(True, f"{chips} TPU chip(s)")
        return Availability(False, "no TPU found and PJRT_DEVICE is not set", NO_DEVICE_HINT)

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

    @classmethod
    def check_precision(cls, selection: Any) -> None:
        if selection.flags.precision == 16:
            raise MisconfigurationError(
                "precision=16 (float16 autocast with a grad scaler) needs CUDA GPUs, but "
                "distributed_backend='tpu' trains on XLA devices. Use precision='bf16' (bfloat16 "
                "autocast, what TPUs compute in), or 32."
            )

    # -- where this process trains ---------------------------------------------------------

    def __init__(self, selection: Any):
        super().__init__(selection)
        self.replicated = False  # a replica of a multi-core job (its collectives are live)
        self.threads = 1  # replicas that are threads of this process (XLA:CPU, v2/v3 TPUs)

    @property
    def core(self) -> int | None:
        """The device index ``tpu_cores=[k]`` names (k-1), or ``None``."""
        cores = self.selection.tpu_cores
        return cores[0] - 1 if isinstance(cores, list) else None

    @property
    def multi_core(self) -> bool:
        """Whether ``tpu_cores`` asks for every core (replicas started by ``xmp.spawn``)."""
        cores = self.selection.tpu_cores
        return isinstance(cores, int) and cores > 1

    def setup_process(self, trainer: Any) -> None:
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        if self.replicated:
            self.device = torch_xla.device()
            self.global_rank = xr.global_ordinal()
            self.local_rank = xr.local_ordinal()
            self.world_size = xr.world_size()
            self.threads = xr.addressable_device_count()
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
        trainer.model.to(self.device)
        super().setup_process(trainer)
        self.moves_batches = True

    def process_dataloader(self, loader: Any, *, train: bool) -> Any:
        loader = super().process_dataloader(loader, train=train)  # the replica's shard
        return DeviceLoader(loader, self.device, self.step_barrier)

    def batch_to_device(self, batch: Any) -> Any:
        """Batches of fit arrive on the device already; ``validate``/``test`` batches come
        from the CPU, and each gets the step barrier first (one graph per batch)."""
        if _holds_cpu_tensor(batch):
            import torch_xla

            torch_xla.sync()
        return move_to(batch, self.device, self.precision.dtype)

    def backward(self, loss: torch.Tensor) -> None:
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

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        import torch_xla.core.xla_model as xm

        xm.optimizer_step(optimizer)  # averages the gradients over the replicas, then steps

    def on_epoch_end(self, trainer: Any) -> None:
        self.step_barrier()  # an epoch cut short by max_steps leaves its last step pending

    def step_barrier(self) -> None:
        """Run the pending graph (``torch_xla.sync()``), the step barrier.

        Replicas that are threads of one process compile one at a time (XLA:CPU's
        all-reduce meets only inside one compiled program: the others find it in the cache),
        then wait for each other, so that no thread starts compiling the next step while
        another has yet to launch this one.
        """
        import torch_xla

        if self.threads <= 1:
            torch_xla.sync()
            return
        with _compile_turn:
            torch_xla.sync()
        _thread_barrier(self.threads).wait()

    # -- collectives ----------------------------------------------------------------------

    def barrier(self, name: str | None = None) -> None:
        """Every replica reaches this point: an all-reduce of one number, run and read.

        (``xm.rendezvous`` does the same through ``all_gather``, but compiles inside without
        the replicas' turn-taking.)
        """
        if not (self.replicated and self.world_size > 1):
            return
        import torch_xla.core.xla_model as xm

        arrived = xm.all_reduce(xm.REDUCE_SUM, torch.ones(1).to(self.device))
        self.step_barrier()
        if int(arrived.cpu().item()) != self.world_size:  # pragma: no cover - XLA's contract
            raise RuntimeError(f"barrier {name!r}: {arrived.item()} of {self.world_size} arrived")

    def broadcast(self, obj: T, src: int = 0) -> T:
        """``obj`` as rank ``src`` holds it: its pickle, sent by ``xm.collective_broadcast``."""
        if not (self.replicated and self.world_size > 1):
            return obj
        import torch_xla.core.xla_model as xm

        data = pickle.dumps(obj) if self.global_rank == src else b""
        size = torch.tensor([len(data)], dtype=torch.int32).to(self.device)
        xm.collective_broadcast([size], root_ordinal=src)
        self.step_barrier()
        length = int(size.cpu().item())
        buffer = torch.zeros(length, dtype=torch.uint8)
        if self.global_rank == src:
            buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        on_device = buffer.to(self.device)
        xm.collective_broadcast([on_device], root_ordinal=src)
        self.step_barrier()
        received: T = pickle.loads(on_device.cpu().numpy().tobytes())
        return received

    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        if not (self.replicated and self.world_size > 1):
            return tensor
        import torch_xla.core.xla_model as xm

        # Through the CPU and back as a vector: XLA bakes a 0-dim 0 or 1 into the program as
        # a constant, and replicas whose programs differ never meet in the all-reduce.
        self.step_barrier()
        values = tensor.detach().cpu().reshape(-1).to(self.device)
        total: torch.Tensor = xm.all_reduce(xm.REDUCE_SUM, values)
        if op == "mean":
            total = total / self.world_size
        self.step_barrier()
        return total.reshape(tensor.shape)

    def portable(self, obj: T) -> T:
        return _to_cpu(obj) if self.device.type == "xla" else obj

    def teardown(self, trainer: Any) -> None:
        import torch_xla.core.xla_model as xm

        if sys.exc_info()[0] is not None:
            return  # training failed here: the peers will never reach the step barrier
        self.step_barrier()
        xm.wait_device_ops()

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

    def launch(self, trainer: Trainer) -> Any:
        import torch_xla.distributed.xla_multiprocessing as xmp

        _choose_device_type()
        xmp.spawn(_fit_here, args=(trainer,), nprocs=1)
        return None


def _fit_here(index: int, trainer: Trainer) -> None:
    trainer.run_fit_loop()


class XmpLauncher(WorkerLauncher):
    """``tpu_cores=8``: a replica per XLA device of this host, from ``xmp.spawn``."""

    unpicklable_hint = "or train on one core (tpu_cores=1)"

    def describe(self, trainer: Trainer) -> str:
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
        with _environment(settings):
            xmp.spawn(_replica, args=(payload, str(folder)))


def _replica(index: int, payload: bytes, folder: str) -> None:
    """One replica of a multi-core job: train; the first of the host leaves the results.

    A replica that fails says so at once, in its error file and on stderr: its peers wait
    for it in a collective, and XLA may end the whole process before the error surfaces.
    """
    try:
        run_worker(payload, folder, before_fit=_mark_replicated)
    except BaseException as error:
        import torch_xla.runtime as xr

        write_error_file(error, Path(folder) / f"rank-{xr.global_ordinal()}.txt")
        traceback.print_exception(type(error), error, error.__traceback__)
        sys.stderr.flush()
        raise


def _mark_replicated(trainer: Trainer) -> None:
    trainer.accelerator.replicated = True  # type: ignore[attr-defined]


@hookimpl
def cardcage_accelerators() -> list[type[Accelerator]]:
    return [TPUAccelerator]
