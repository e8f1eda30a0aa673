"""The parts of cardcage-tpu that need no XLA device: what ``tpu_cores`` means to the backend,
precision, and how the job travels to the replicas. They pass with or without torch-xla."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from cardcage import Availability, MisconfigurationError, sdk, select

ALONE = {"CARDCAGE_PLUGINS_AUTOLOAD": "0", "CARDCAGE_PLUGINS": "tpu"}


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The tpu backend class, made available whatever is installed."""
    cls = sdk.registry(ALONE).accelerators["tpu"].cls
    monkeypatch.setattr(cls, "availability", classmethod(lambda c, ctx: Availability(True)))
    return cls


@pytest.mark.parametrize(
    ("tpu_cores", "core", "multi_core", "processes"),
    [
        (1, None, False, 1),
        ("1", None, False, 1),
        (8, None, True, 8),
        ([1], 0, False, 1),
        ("5,", 4, False, 1),
        ([8], 7, False, 1),
    ],
)
def test_tpu_cores_as_the_backend_reads_it(
    backend: Any, tpu_cores: Any, core: int | None, multi_core: bool, processes: int
) -> None:
    selection = select(env=ALONE, tpu_cores=tpu_cores)
    accelerator = backend(selection)
    # Core k of Lightning's 1..8 is PJRT's device k-1 (XRT's xla:0 was the host).
    assert (accelerator.core, accelerator.multi_core) == (core, multi_core)
    assert selection.num_processes == processes


def test_precision_16_is_refused_with_bf16_offered(backend: Any) -> None:
    selection = select(env=ALONE, tpu_cores=1, precision=16)
    with pytest.raises(MisconfigurationError, match=r"precision=16 .* Use precision='bf16'"):
        backend.check_precision(selection)
    backend.check_precision(select(env=ALONE, tpu_cores=1, precision="bf16"))


def pickled(job: Any) -> bytes:
    from cardcage_tpu import XmpLauncher

    return XmpLauncher(None).pickle(job)  # type: ignore[arg-type]


def test_the_job_travels_as_plain_pickle_copies() -> None:
    model = torch.nn.Linear(2, 2)
    flags = SimpleNamespace(tpu_cores=8)
    job = SimpleNamespace(model=model, train_dataloader=[1], val_dataloaders=[], flags=flags)
    copy = pickle.loads(pickled(job))
    assert copy.model.weight.data_ptr() != model.weight.data_ptr()
    assert torch.equal(copy.model.weight, model.weight)


def test_an_unpicklable_model_is_named_before_anything_starts() -> None:
    model = torch.nn.Linear(2, 2)
    model.hook = lambda: None  # type: ignore[assignment]
    job = SimpleNamespace(
        model=model,
        train_dataloader=[1],
        val_dataloaders=[],
        flags=SimpleNamespace(tpu_cores=8),
    )
    with pytest.raises(MisconfigurationError, match=r"tpu_cores=8 sends the model .* pickl"):
        pickled(job)


def test_launch_settings_are_added_where_unset_and_taken_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Every core on XLA's CPU device: xmp.spawn starts the replicas with the synchronous CPU
    client, unless the user chose one; the setting is taken back afterwards."""
    pytest.importorskip("torch_xla", reason="torch_xla is not installed (nox -s tpu has it)")
    import torch_xla
    import torch_xla.distributed.xla_multiprocessing as xmp
    from cardcage_tpu import XmpLauncher

    seen: list[str | None] = []
    monkeypatch.setattr(torch_xla._XLAC, "_xla_runtime_is_initialized", lambda: False)
    monkeypatch.setattr(
        xmp, "spawn", lambda fn, args: seen.append(os.environ.get("PJRT_CPU_ASYNC_CLIENT"))
    )
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.delenv("PJRT_CPU_ASYNC_CLIENT", raising=False)
    XmpLauncher(None).start_workers(b"", tmp_path)  # type: ignore[arg-type]
    assert "PJRT_CPU_ASYNC_CLIENT" not in os.environ
    monkeypatch.setenv("PJRT_CPU_ASYNC_CLIENT", "1")
    XmpLauncher(None).start_workers(b"", tmp_path)  # type: ignore[arg-type]
    assert os.environ["PJRT_CPU_ASYNC_CLIENT"] == "1"
    assert seen == ["0", "1"]  # the user's setting wins
