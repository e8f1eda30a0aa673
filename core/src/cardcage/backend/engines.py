"""Backends whose engine is not torch.distributed (torch-xla, a vendor runtime).

Such an engine brings its own settings (read from ``os.environ``), its own device loader and
its own collectives, often for tensors only, and may record each step lazily to run it as
one compiled program. What a backend builds on it is the same whatever the engine:
:class:`EngineStrategy`, the per-process methods given the engine's few primitives, and its
parts: :func:`environ` (settings for a while), :func:`holds_cpu_tensor` and
:class:`EngineLoader` (batches), :func:`broadcast_object` (an object through a tensor
broadcast) and :func:`take_turns` (replicas that are threads of one process, in step).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch

from cardcage.backend.strategy.strategy import Strategy
from cardcage.config.variables import init_timeout

T = TypeVar("T")


@contextlib.contextmanager
def environ(values: Mapping[str, str], *, override: bool = False) -> Iterator[None]:
    """``os.environ`` with ``values`` for the duration, then as it was.

    A variable that is set keeps its value (the user's setting wins) unless ``override``.
    For an engine that reads its settings from the environment: on import, or in the
    processes and threads it starts inside.
    """
    before = {key: os.environ.get(key) for key in values}
    changed = {key: value for key, value in values.items() if override or before[key] is None}
    os.environ.update(changed)
    try:
        yield
    finally:
        for key in changed:
            previous = before[key]
            if previous is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = previous


def holds_cpu_tensor(batch: Any) -> bool:
    """Whether ``batch`` (a tensor, or lists, tuples and dicts of them, nested as
    :func:`~cardcage.backend.strategy.strategy.move_to` walks them) holds a tensor that is on
    the CPU."""
    if isinstance(batch, torch.Tensor):
        return batch.device.type == "cpu"
    if isinstance(batch, (list, tuple)):
        return any(holds_cpu_tensor(item) for item in batch)
    if isinstance(batch, dict):
        return any(holds_cpu_tensor(item) for item in batch.values())
    return False


class EngineLoader:
    """The loop's loader over an engine's device loader: the batches of ``batches`` (which
    iterates over ``loader``, uploading in the background), with ``before_batch()`` called
    before each and once at the end (a step barrier, say).

    ``sampler`` and ``len`` are ``loader``'s, so that a distributed sampler is told the epoch.
    """

    def __init__(
        self, loader: Any, batches: Iterable[Any], before_batch: Callable[[], None]
    ) -> None:
        self.loader = loader
        self.sampler = getattr(loader, "sampler", None)
        self.batches = batches
        self.before_batch = before_batch

    def __iter__(self) -> Iterator[Any]:
        batches = iter(self.batches)
        while True:
            self.before_batch()
            try:
                batch = next(batches)
            except StopIteration:
                return
            yield batch

    def __len__(self) -> int:
        return len(self.loader)


def broadcast_object(
    obj: T,
    src: int,
    rank: int,
    broadcast: Callable[[torch.Tensor], None],
    device: torch.device | str = "cpu",
) -> T:
    """``obj`` as rank ``src`` holds it, for an engine that broadcasts tensors only.

    ``broadcast(tensor)``, called on every rank, makes ``tensor`` (on ``device``) equal to
    rank ``src``'s in place. ``obj`` travels pickled, as bytes in a uint8 tensor, after its
    length (an int32, which the other ranks size their buffer by): two broadcasts.
    """
    data = pickle.dumps(obj) if rank == src else b""
    size = torch.tensor([len(data)], dtype=torch.int32).to(device)
    broadcast(size)
    if rank == src:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        buffer = torch.zeros(int(size.cpu().item()), dtype=torch.uint8)
    on_device = buffer.to(device)
    broadcast(on_device)
    received: T = pickle.loads(on_device.cpu().numpy().tobytes())
    return received


_turn = threading.Lock()
_barriers: dict[int, threading.Barrier] = {}
_barriers_guard = threading.Lock()


def take_turns(step: Callable[[], None], parties: int, timeout: float | None = None) -> None:
    """Run ``step()`` while no other thread of this process runs one, then wait until
    ``parties`` threads have (a barrier, of ``timeout`` seconds).

    For replicas that are threads of one process, on an engine whose collectives meet only
    inside one compiled program (XLA's CPU device): the first thread to reach a new step
    compiles it and the others find its program in the cache, and none starts compiling the
    next step while another has yet to launch this one. A barrier that broke (a thread
    failed or timed out: ``threading.BrokenBarrierError``) is replaced at the next call.
    """
    with _turn:
        step()
    with _barriers_guard:
        barrier = _barriers.get(parties)
        if barrier is None or barrier.broken:
            barrier = _barriers[parties] = threading.Barrier(parties, timeout=timeout)
    barrier.wait()


class EngineStrategy(Strategy):
    """The per-process methods of a backend on an engine of its own, from its primitives.

    List it before ``Accelerator`` (``class FooAccelerator(EngineStrategy, Accelerator)``)
    and implement :meth:`sync` (for a lazy engine), :meth:`device_loader`,
    :meth:`all_reduce_sum` and :meth:`broadcast_tensor`. In return: a *step barrier* before
    every batch and after every epoch (each step runs as one program), loaders that upload
    in the background, batches of ``validate``/``test`` moved after it, and ``barrier``,
    ``broadcast`` and ``reduce`` over the engine's collectives, each run at once.
    """

    #: Replicas that are threads of this process (set in ``setup_process``); more than one
    #: take turns at the step barrier (:func:`take_turns`, ``CARDCAGE_INIT_TIMEOUT``).
    threads: int = 1

    def sync(self) -> None:
        """Run what the engine has pending (``torch_xla.sync()``); nothing for an eager one."""

    def device_loader(self, loader: Any) -> Iterable[Any]:
        """The engine's loader over ``loader``: batches on the device, uploaded in the
        background. The default is ``loader``."""
        loader_batches: Iterable[Any] = loader
        return loader_batches

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks by the engine (pending until :meth:`sync`)."""
        raise NotImplementedError(f"{type(self).__name__} implements no all_reduce_sum")

    def broadcast_tensor(self, tensor: torch.Tensor, src: int) -> None:
        """Make ``tensor`` rank ``src``'s, in place, on every rank (pending until :meth:`sync`)."""
        raise NotImplementedError(f"{type(self).__name__} implements no broadcast_tensor")

    @property
    def collectives_live(self) -> bool:
        """Whether the collectives run (else they are identities): several ranks."""
        return self.world_size > 1

    def step_barrier(self) -> None:
        """:meth:`sync`; replicas that are threads of this process take turns at it, then
        line up (see :func:`take_turns` for why)."""
        if self.threads <= 1:
            self.sync()
        else:
            take_turns(self.sync, self.threads, init_timeout())

    def process_dataloader(self, loader: Any, *, train: bool) -> Any:
        """This rank's shard (the default sampler), through :meth:`device_loader`, with the
        step barrier before every batch (:class:`EngineLoader`)."""
        loader = super().process_dataloader(loader, train=train)
        return EngineLoader(loader, self.device_loader(loader), self.step_barrier)

    def batch_to_device(self, batch: Any) -> Any:
        """Batches of ``fit`` arrive on the device already; ``validate``/``test`` batches from
        the CPU each get :meth:`sync` first (one program per batch), then move."""
        if holds_cpu_tensor(batch):
            self.sync()
        return super().batch_to_device(batch)

    def read(self, tensor: torch.Tensor) -> torch.Tensor:
        """A CPU copy of ``tensor`` now, mid-step. Replica threads take turns at it: each runs
        a program of its own to compute it, and two threads doing so at once can crash
        XLA:CPU (a segfault, seen in the kit's job)."""
        if self.threads <= 1:
            return super().read(tensor)
        copies: list[torch.Tensor] = []
        take_turns(lambda: copies.append(tensor.detach().cpu()), self.threads, init_timeout())
        return copies[0]

    def on_epoch_end(self, trainer: Any) -> None:
        """The step barrier: an epoch cut short by ``max_steps`` leaves its last step pending."""
        self.step_barrier()

    def barrier(self, name: str | None = None) -> None:
        """Every rank reaches this point: an all-reduce of one number, run and read."""
        if not self.collectives_live:
            return
        arrived = self.all_reduce_sum(torch.ones(1).to(self.device))
        self.step_barrier()
        if int(arrived.cpu().item()) != self.world_size:  # pragma: no cover - the engine's
            raise RuntimeError(f"barrier {name!r}: {arrived.item()} of {self.world_size} arrived")

    def broadcast(self, obj: T, src: int = 0) -> T:
        """``obj`` as rank ``src`` holds it, pickled, through :meth:`broadcast_tensor`."""
        if not self.collectives_live:
            return obj

        def send(tensor: torch.Tensor) -> None:
            self.broadcast_tensor(tensor, src)
            self.step_barrier()

        return broadcast_object(obj, src, self.global_rank, send, self.device)

    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """``tensor`` summed (or averaged) by :meth:`all_reduce_sum`, between step barriers.

        It travels through the CPU and back as a vector: a compiling engine (XLA) bakes a
        0-dim 0 or 1 into the program as a constant, and ranks whose programs differ never
        meet in the all-reduce.
        """
        if not self.collectives_live:
            return tensor
        self.step_barrier()
        values = tensor.detach().cpu().reshape(-1).to(self.device)
        total = self.all_reduce_sum(values)
        if op == "mean":
            total = total / self.world_size
        self.step_barrier()
        return total.reshape(tensor.shape)
