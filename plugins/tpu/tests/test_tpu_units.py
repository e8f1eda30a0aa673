"""The parts of cardcage-tpu that need no XLA device: what ``tpu_cores`` means to the backend,
precision, and how the job travels to the replicas. They pass with or without torch-xla; the
launch settings of every core are checked through a real ``xmp.spawn`` on XLA's CPU device,
where torch-xla is installed (``nox -s tpu``)."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from cardcage import Availability, MisconfigurationError, sdk, select

ALONE = {"CARDCAGE_PLUGINS_AUTOLOAD": "0", "CARDCAGE_PLUGINS": "tpu"}
HERE = Path(__file__).parent


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
    with pytest.raises(MisconfigurationError, match=r"precision=16 .* Use precision='bf16'"):
        select(env=ALONE, tpu_cores=1, precision=16)  # select refuses what the Trainer does
    backend.check_precision(select(env=ALONE, tpu_cores=1, precision="bf16"))


def pickled(job: Any) -> bytes:
    from cardcage_tpu import XmpLauncher

    return XmpLauncher(None).pickle(job)  # type: ignore[arg-type]


class Job(SimpleNamespace):
    """What xmp's launcher pickles: a Trainer's model and loaders, or a Cage's fn and args,
    which it names (``pickled_parts``) when the whole does not pickle."""

    def pickled_parts(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "flags"}


def test_the_job_travels_as_plain_pickle_copies() -> None:
    model = torch.nn.Linear(2, 2)
    flags = SimpleNamespace(tpu_cores=8)
    job = Job(model=model, train_dataloader=[1], val_dataloaders=[], flags=flags)
    copy = pickle.loads(pickled(job))
    assert copy.model.weight.data_ptr() != model.weight.data_ptr()
    assert torch.equal(copy.model.weight, model.weight)


def test_an_unpicklable_model_is_named_before_anything_starts() -> None:
    model = torch.nn.Linear(2, 2)
    model.hook = lambda: None  # type: ignore[assignment]
    job = Job(model=model, train_dataloader=[1], flags=SimpleNamespace(tpu_cores=8))
    with pytest.raises(MisconfigurationError, match=r"tpu_cores=8 sends the model .* pickl"):
        pickled(job)


def test_an_unpicklable_function_of_a_cage_is_named_before_anything_starts() -> None:
    job = Job(
        fn=lambda cage: None, args=[torch.nn.Linear(2, 2)], flags=SimpleNamespace(tpu_cores=8)
    )
    with pytest.raises(MisconfigurationError, match=r"tpu_cores=8 sends the fn .* pickl"):
        pickled(job)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("torch_xla") is None,
    reason="torch_xla is not installed: run `nox -s tpu` (torch 2.9.0 + torch-xla 2.9.0)",
)
def test_launch_settings_are_added_where_unset_and_taken_back(tmp_path: Path) -> None:
    """Every core on XLA's CPU device, through the real xmp.spawn in a fresh process: the
    replicas run with the synchronous CPU client unless the user chose one (the user's setting
    wins), and the calling process has the variable as it was once fit returns."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", **ALONE}
    command = [sys.executable, str(HERE / "xla_launch_settings.py"), str(tmp_path)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    seen = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*-replica-*.json")}
    assert seen == {"unset-replica-0": "0", "unset-replica-1": "0", "user-replica-0": "1"}
    after = json.loads((tmp_path / "after.json").read_text())
    # Taken back by the launcher itself, and after fit; the user's setting left alone.
    assert after == {"launch-0": None, "unset": None, "launch-1": "1", "user": "1"}
