"""The SDK for backends on an engine other than torch.distributed (``cardcage.backend.engines``:
``EngineStrategy`` and its parts), the torch-release check of ``availability``, the
defaults of a backend that trains on ``tpu_cores``, and a worker that reports its failure at
once (``run_worker(..., failure_rank=...)``)."""

from __future__ import annotations

import importlib.metadata
import os
import pickle
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from cardcage import select
from cardcage.sdk import (
    Accelerator,
    Availability,
    EngineLoader,
    EngineStrategy,
    MisconfigurationError,
    broadcast_object,
    environ,
    holds_cpu_tensor,
    matching_torch_release,
    run_worker,
    take_turns,
)

UNSET = "CARDCAGE_TEST_ENGINE_UNSET"
SET = "CARDCAGE_TEST_ENGINE_SET"


def test_environ_adds_unset_variables_and_takes_them_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(UNSET, raising=False)
    monkeypatch.setenv(SET, "user")
    with environ({UNSET: "0", SET: "engine"}):
        assert (os.environ[UNSET], os.environ[SET]) == ("0", "user")  # the user's setting wins
    assert UNSET not in os.environ
    assert os.environ[SET] == "user"


def test_environ_overrides_for_the_duration_even_after_a_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(UNSET, raising=False)
    monkeypatch.setenv(SET, "user")
    with pytest.raises(RuntimeError), environ({UNSET: "0", SET: "engine"}, override=True):
        assert (os.environ[UNSET], os.environ[SET]) == ("0", "engine")
        raise RuntimeError
    assert UNSET not in os.environ
    assert os.environ[SET] == "user"


@pytest.mark.parametrize(
    ("batch", "holds"),
    [
        (torch.ones(2), True),
        (torch.ones(2, device="meta"), False),
        ([torch.ones(2, device="meta"), {"x": (torch.ones(1),)}], True),
        ({"x": [torch.ones(1, device="meta")], "y": "text"}, False),
        (("text", 3, None), False),
    ],
)
def test_holds_cpu_tensor_looks_inside_nested_batches(batch: Any, holds: bool) -> None:
    assert holds_cpu_tensor(batch) is holds


def test_engine_loader_calls_before_batch_before_each_batch_and_at_the_end() -> None:
    events: list[Any] = []
    sampler = object()

    class Loader(list[int]):
        pass

    loader = Loader([1, 2, 3])
    loader.sampler = sampler  # type: ignore[attr-defined]
    wrapped = EngineLoader(loader, (10 * b for b in loader), lambda: events.append("sync"))
    for batch in wrapped:
        events.append(batch)
    assert events == ["sync", 10, "sync", 20, "sync", 30, "sync"]
    assert (wrapped.sampler, len(wrapped)) == (sampler, 3)


def _ranks(world_size: int, work: Callable[[int], Any]) -> list[Any]:
    """``work(rank)`` in one thread per rank; their results, by rank."""
    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors, errors
    return results


def test_broadcast_object_sends_rank_src_s_object_through_a_tensor_broadcast() -> None:
    world_size, src = 3, 1
    slot: list[torch.Tensor] = []
    meet = threading.Barrier(world_size, timeout=10)
    calls = [0] * world_size

    def work(rank: int) -> Any:
        def broadcast(tensor: torch.Tensor) -> None:
            # What a collective does: every rank's tensor becomes rank src's, in place.
            calls[rank] += 1
            if rank == src:
                slot.append(tensor.clone())
            meet.wait()
            tensor.copy_(slot[-1])
            meet.wait()

        return broadcast_object(
            {"rank": rank, "data": list(range(rank * 1000))}, src, rank, broadcast
        )

    received = _ranks(world_size, work)
    assert received == [{"rank": src, "data": list(range(src * 1000))}] * world_size
    assert calls == [2] * world_size  # the length, then the bytes
    assert pickle.loads(slot[-1].numpy().tobytes()) == received[0]


def test_take_turns_runs_one_step_at_a_time_and_lines_the_threads_up() -> None:
    parties, steps = 3, 4
    running, overlaps, log = [0], [0], []
    lock = threading.Lock()

    def work(rank: int) -> None:
        for step in range(steps):

            def one_step(step: int = step) -> None:
                with lock:
                    running[0] += 1
                    overlaps[0] = max(overlaps[0], running[0])
                time.sleep(0.005 * (parties - rank))  # the first ranks are the slow ones
                with lock:
                    running[0] -= 1
                    log.append(step)

            take_turns(one_step, parties, timeout=10)

    _ranks(parties, work)
    assert overlaps[0] == 1  # never two steps at once
    # No thread starts step s+1 before every thread has finished step s.
    assert log == sorted(log)
    assert len(log) == parties * steps


def test_take_turns_times_out_without_the_other_threads() -> None:
    with pytest.raises(threading.BrokenBarrierError):
        take_turns(lambda: None, 2, timeout=0.1)
    # The broken barrier is replaced: two threads meet again.
    _ranks(2, lambda rank: take_turns(lambda: None, 2, timeout=10))


def test_matching_torch_release_compares_major_and_minor(monkeypatch: pytest.MonkeyPatch) -> None:
    versions = {"torch": "2.9.1+cpu", "engine-a": "2.9.0", "engine-b": "2.8.0+tpu"}
    monkeypatch.setattr(importlib.metadata, "version", versions.__getitem__)
    assert matching_torch_release("engine-a", "pip install engine-a==2.9")
    missing = matching_torch_release("engine-b", "pip install engine-b==2.9")
    assert not missing
    assert (
        missing.reason == "engine-b 2.8.0+tpu needs torch 2.8.*, but torch 2.9.1+cpu is installed"
    )
    assert missing.hint == "pip install engine-b==2.9"


def test_run_worker_with_failure_rank_reports_the_failure_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = b"not a pickle"  # the worker fails before training starts
    with pytest.raises(pickle.UnpicklingError):
        run_worker(broken, tmp_path, failure_rank=lambda: 3)
    assert "UnpicklingError" in (tmp_path / "rank-3.txt").read_text()
    assert "UnpicklingError" in capsys.readouterr().err
    # Without failure_rank the error only propagates (the launcher's CARDCAGE_ERROR_FILE
    # or the runner reports it).
    (tmp_path / "rank-3.txt").unlink()
    with pytest.raises(pickle.UnpicklingError):
        run_worker(broken, tmp_path)
    assert not list(tmp_path.iterdir())
    assert capsys.readouterr().err == ""


class Group:
    """What an engine's collectives do between the threads that stand for its ranks."""

    def __init__(self, size: int) -> None:
        self.slots: list[torch.Tensor | None] = [None] * size
        self.meet = threading.Barrier(size, timeout=10)

    def exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = tensor.clone()
        self.meet.wait()
        values = [slot for slot in self.slots if slot is not None]
        self.meet.wait()
        return values


class FakeEngine(EngineStrategy):
    """An engine on the CPU that records its syncs; its collectives go through ``group``."""

    def __init__(self, rank: int = 0, group: Group | None = None) -> None:
        size = len(group.slots) if group else 1
        flags = SimpleNamespace(precision=32, replace_sampler_ddp=True)
        place = SimpleNamespace(
            flags=flags, global_rank=rank, local_rank=rank, world_size=size, node_rank=0
        )
        super().__init__(place)  # type: ignore[arg-type]
        self.group = group
        self.events: list[Any] = []

    def sync(self) -> None:
        self.events.append("sync")

    def device_loader(self, loader: Any) -> Any:
        return (("uploaded", batch.tolist()) for batch in loader)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        assert self.group is not None
        return torch.stack(self.group.exchange(self.global_rank, tensor)).sum(0)

    def broadcast_tensor(self, tensor: torch.Tensor, src: int) -> None:
        assert self.group is not None
        tensor.copy_(self.group.exchange(self.global_rank, tensor)[src])


def test_engine_strategy_runs_each_batch_behind_the_step_barrier() -> None:
    engine = FakeEngine()
    loader = engine.process_dataloader(DataLoader(list(range(4)), batch_size=2), train=True)
    assert len(loader) == 2
    for batch in loader:
        engine.events.append(batch)
    engine.on_epoch_end(None)
    assert engine.events == [
        "sync",
        ("uploaded", [0, 1]),
        "sync",
        ("uploaded", [2, 3]),
        "sync",
        "sync",
    ]
    engine.events.clear()
    engine.device = torch.device("meta")  # the engine's device, here
    engine.batch_to_device(torch.ones(1, device="meta"))  # on the device already: no sync
    assert engine.events == []
    assert engine.batch_to_device([torch.ones(1)])[0].device.type == "meta"
    assert engine.events == ["sync"]  # one from the CPU: the pending step runs first


def test_engine_strategy_collectives_are_identities_for_one_rank() -> None:
    engine = FakeEngine()
    engine.barrier()
    assert engine.broadcast({"a": 1}) == {"a": 1}
    tensor = torch.tensor(3.0)
    assert engine.reduce(tensor) is tensor
    assert engine.events == []  # and the engine's collectives (absent) were never called


def test_engine_strategy_collectives_over_the_engine_s_tensor_collectives() -> None:
    size = 3
    group = Group(size)

    def work(rank: int) -> Any:
        engine = FakeEngine(rank, group)
        engine.threads = size  # replicas that are threads: the step barrier takes turns
        engine.barrier("meet")
        got = engine.broadcast({"from": rank, "items": [rank] * 100}, src=2)
        mean = engine.reduce(torch.tensor(float(rank + 1)))
        total = engine.reduce(torch.tensor([[rank], [1]]), op="sum")
        return got, mean, total, engine.events.count("sync")

    results = _ranks(size, work)
    for got, mean, total, syncs in results:
        assert got == {"from": 2, "items": [2] * 100}
        assert (mean.shape, mean.item()) == ((), 2.0)  # 0-dim stays 0-dim
        assert total.tolist() == [[3], [3]]
        assert syncs == 1 + 2 + 2 + 2  # each collective run at once


class CoresAccelerator(Accelerator):
    """A third-party backend that trains on ``tpu_cores``, with the core's defaults."""

    name = "cores"
    uses_tpu_cores = True

    @classmethod
    def availability(cls, ctx: Any) -> Availability:
        return Availability(True)


@pytest.fixture
def cores(inprocess_accelerators: Callable[..., None]) -> None:
    inprocess_accelerators("cores", CoresAccelerator)


def test_a_tpu_cores_backend_reads_tpu_cores_as_lightning_did(
    cores: None, cuda_count_0: int
) -> None:
    with pytest.raises(MisconfigurationError, match=r"'cores' needs tpu_cores.*tpu_cores=1"):
        select(env={}, distributed_backend="cores")
    every = select(env={}, distributed_backend="cores", tpu_cores=8)
    assert (every.accelerator, every.num_processes, every.world_size) == ("cores", 8, 8)
    one = select(env={}, distributed_backend="cores", tpu_cores=[3])
    assert (one.num_processes, one.world_size) == (1, 1)
    with pytest.raises(MisconfigurationError, match=r"precision=16 .* Use precision='bf16'"):
        select(env={}, distributed_backend="cores", tpu_cores=1, precision=16)
    CoresAccelerator.check_precision(select(env={}, distributed_backend="cores", tpu_cores=1))
