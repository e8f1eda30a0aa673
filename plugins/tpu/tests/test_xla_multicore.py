"""Every core (``tpu_cores=8``) on XLA's CPU device: two replicas (``CPU_NUM_DEVICES=2``),
threads of the one process ``xmp.spawn`` starts there, trained in a fresh process (``xmp.spawn``
needs one that has not used XLA). Also core 2 of two devices, and a core beyond them.

Skipped, with the reason, where torch_xla is not installed (``nox -s tpu`` installs it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("torch_xla") is None,
        reason="torch_xla is not installed: run `nox -s tpu` (torch 2.9.0 + torch-xla 2.9.0)",
    ),
    pytest.mark.slow,
]

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from xla_jobs import BATCH, EPOCHS, Net, dataset  # noqa: E402

REPLICAS = 2
TOLERANCE = 1e-4


def run_jobs(out: Path, *jobs: str) -> None:
    """Run ``jobs`` in a fresh process with two XLA CPU devices; their results go to ``out``."""
    env = {
        **os.environ,
        "PJRT_DEVICE": "CPU",
        "CPU_NUM_DEVICES": str(REPLICAS),
        "CARDCAGE_PLUGINS_AUTOLOAD": "0",
        "CARDCAGE_PLUGINS": "tpu",
    }
    env.pop("PJRT_CPU_ASYNC_CLIENT", None)
    command = [sys.executable, str(HERE / "xla_jobs.py"), str(out), *jobs]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    (out / "output.txt").write_text(result.stdout + result.stderr)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run the jobs once (every core first: ``xmp.spawn`` needs a process new to XLA)."""
    out = tmp_path_factory.mktemp("xla-jobs")
    run_jobs(out, "multicore", "core2", "core3")
    return out


def outcome(folder: Path, job: str) -> dict[str, Any]:
    error = folder / f"{job}.error"
    assert not error.exists(), error.read_text()
    loaded: dict[str, Any] = torch.load(folder / f"{job}.pt", weights_only=True)
    return loaded


def model_with(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = Net()
    model.load_state_dict(state)
    return model


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def replicas_reference(initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain CPU loop equivalent to ``REPLICAS`` replicas with averaged gradients.

    A DistributedSampler shuffles with seed ``epoch`` and deals index i to replica
    ``i % REPLICAS``; the replicas' averaged batch means are the mean over their union, the
    next ``REPLICAS * BATCH`` indices of the permutation.
    """
    model = model_with(initial)
    optimizer = model.configure_optimizers()
    data = dataset()
    for epoch in range(EPOCHS):
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True)
        sampler.set_epoch(epoch)
        order = list(sampler)
        step = REPLICAS * BATCH
        for start in range(0, len(order), step):
            x, y = data[order[start : start + step]]
            optimizer.zero_grad()
            model.training_step((x, y), 0).backward()
            optimizer.step()
    return model.state_dict()


def test_every_core_trains_replicas_that_average_their_gradients(jobs: Path) -> None:
    result = outcome(jobs, "multicore")
    reference = replicas_reference(result["initial"])
    difference = max_difference(result["state_dict"], reference)
    print(f"tpu_cores=8 on {REPLICAS} XLA CPU devices vs plain CPU loop: {difference:.3g}")
    assert difference < TOLERANCE
    # Rank 0's weights, metrics and counters came back to the calling process, on the CPU.
    assert result["device"] == "cpu"
    assert result["global_step"] == EPOCHS * len(dataset()) // (REPLICAS * BATCH)
    assert result["selection"]["tpu_cores"] == 8 and result["selection"]["accelerator"] == "tpu"
    # Validation ran sharded and was averaged over the replicas: the loss on all the data.
    x, y = dataset().tensors
    full = torch.nn.functional.mse_loss(model_with(result["state_dict"])(x), y).item()
    assert result["logged_metrics"]["val_loss"] == pytest.approx(full, abs=1e-5)


def test_the_replicas_broadcast_meet_and_reduce(jobs: Path) -> None:
    seen = [json.loads((jobs / f"rank-{r}.json").read_text()) for r in range(REPLICAS)]
    assert [s["rank"] for s in seen] == [0, 1]
    assert [s["device"] for s in seen] == ["xla:0", "xla:1"]
    for s in seen:
        assert s["world_size"] == REPLICAS
        assert s["broadcast"] == {"from": 1, "items": [1, 2, 3]}
        assert s["sum"] == 3.0 and s["mean"] == 1.5


def test_rank_0_writes_the_checkpoint_every_replica_waits(jobs: Path) -> None:
    saved = torch.load(jobs / "mid.ckpt", weights_only=True)
    assert (saved["epoch"], saved["global_step"]) == (1, len(dataset()) // (REPLICAS * BATCH))
    assert {t.device.type for t in saved["state_dict"].values()} == {"cpu"}
    assert not list(jobs.glob(".mid.ckpt.*"))  # no temporary file left behind


def plain_cpu_loop(initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    model = model_with(initial)
    optimizer = model.configure_optimizers()
    torch.manual_seed(5)
    loader = DataLoader(dataset(), batch_size=BATCH, shuffle=True)
    for _ in range(EPOCHS):
        for index, batch in enumerate(loader):
            optimizer.zero_grad()
            model.training_step(batch, index).backward()
            optimizer.step()
    return model.state_dict()


def test_core_2_is_the_second_device(jobs: Path) -> None:
    result = outcome(jobs, "core2")
    assert result["selection"]["tpu_cores"] == [2]
    assert result["accelerator_device"] == "xla:1" and result["device"] == "xla:1"
    difference = max_difference(result["state_dict"], plain_cpu_loop(result["initial"]))
    print(f"tpu_cores=[2] (xla:1) vs plain CPU loop: {difference:.3g}")
    assert difference < TOLERANCE


def test_a_core_beyond_the_devices_fails_naming_them(jobs: Path) -> None:
    error = (jobs / "core3.error").read_text()
    assert "MisconfigurationError" in error
    assert "names core 3 (device xla:2), but this host's XLA runtime has 2 device(s)" in error


def test_terminate_on_nan_stops_every_replica_naming_the_step(tmp_path: Path) -> None:
    """Each step's loss is read mid-step (``EngineStrategy.read``: the replica threads take
    turns, as two XLA:CPU threads running programs of their own at once can crash it)."""
    run_jobs(tmp_path, "nan")
    error = (tmp_path / "nan.error").read_text()
    assert "NonFiniteLossError" in error, error
    assert (
        "training_step returned a loss of nan at global_step=3 (epoch 0, batch_idx=3) on rank 1"
        in error
    )
