"""Training on XLA's CPU device (``PJRT_DEVICE=CPU``) in this process: one core, a named core,
checkpoints, bf16, evaluation. Skipped, with the reason, where torch_xla is not installed
(``nox -s tpu`` installs it)."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch_xla") is None,
    reason="torch_xla is not installed: run `nox -s tpu` (torch 2.9.0 + torch-xla 2.9.0)",
)

sys.path.insert(0, str(Path(__file__).parent))
from xla_jobs import BATCH, Net, dataset  # noqa: E402

from cardcage import MisconfigurationError, Trainer, select  # noqa: E402

TOLERANCE = 1e-4
ONLY_TPU = {"CARDCAGE_PLUGINS_AUTOLOAD": "0", "CARDCAGE_PLUGINS": "tpu"}


def plain_cpu_loop(model: torch.nn.Module, epochs: int, seed: int) -> torch.nn.Module:
    """What a hand-written loop on the CPU does, for comparison."""
    optimizer = model.configure_optimizers()  # type: ignore[operator]
    torch.manual_seed(seed)
    loader = DataLoader(dataset(), batch_size=BATCH, shuffle=True)
    for _ in range(epochs):
        for index, batch in enumerate(loader):
            optimizer.zero_grad()
            model.training_step(batch, index).backward()  # type: ignore[operator]
            optimizer.step()
    return model


def max_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    return max((x.detach().cpu() - y.detach().cpu()).abs().max().item() for x, y in pairs)


def fit_on_xla(model: torch.nn.Module, seed: int = 5, **flags: Any) -> Trainer:
    flags.setdefault("tpu_cores", 1)
    flags.setdefault("max_epochs", 2)
    trainer = Trainer(**flags)
    torch.manual_seed(seed)
    trainer.fit(model, DataLoader(dataset(), batch_size=BATCH, shuffle=True))
    return trainer


def test_it_is_available_with_pjrt_device_cpu() -> None:
    selection = select(env={**ONLY_TPU, "PJRT_DEVICE": "CPU"}, tpu_cores=1)
    assert (selection.accelerator, selection.rule) == ("tpu", "tpu_cores")
    entry = next(e for e in selection.trace if e.accelerator == "tpu")
    assert entry.outcome == "claimed"


def test_without_a_tpu_or_pjrt_device_it_is_unavailable() -> None:
    from cardcage_tpu import _tpu_chips

    if _tpu_chips():
        pytest.skip("a TPU is attached here")
    # torch_xla alone would quietly fall back to its CPU device.
    with pytest.raises(MisconfigurationError, match="no TPU found and PJRT_DEVICE is not set"):
        select(env=ONLY_TPU, distributed_backend="tpu", tpu_cores=1)
    assert "PJRT_SELECT_DEFAULT_DEVICE" not in os.environ


def test_one_core_reaches_the_weights_of_a_plain_cpu_loop() -> None:
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    trainer = fit_on_xla(model, tpu_cores=1)
    plain_cpu_loop(reference, epochs=2, seed=5)
    difference = max_difference(model, reference)
    print(f"tpu_cores=1 vs plain CPU loop: max |difference| = {difference:.3g}")
    assert difference < TOLERANCE
    assert trainer.accelerator.device.type == "xla"
    assert next(model.parameters()).device.type == "xla"  # trained in place, on the device
    assert trainer.global_step == 2 * len(dataset()) // BATCH
    assert len(trainer.losses) == trainer.global_step


def test_a_named_core_selects_and_uses_that_device() -> None:
    import torch_xla

    selection = select(env={**ONLY_TPU, "PJRT_DEVICE": "CPU"}, tpu_cores=[1])
    assert (selection.tpu_cores, selection.num_processes, selection.world_size) == ([1], 1, 1)
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    trainer = fit_on_xla(model, tpu_cores=[1])
    # Core 1 of 1..8 is PJRT's first device (Lightning 1.0's XRT numbered the cores from 1).
    assert trainer.accelerator.device == torch_xla.devices()[0]
    assert next(model.parameters()).device == trainer.accelerator.device
    difference = max_difference(model, plain_cpu_loop(reference, epochs=2, seed=5))
    print(f"tpu_cores=[1] vs plain CPU loop: max |difference| = {difference:.3g}")
    assert difference < TOLERANCE


def test_a_core_beyond_the_devices_is_named_in_the_error() -> None:
    trainer = Trainer(tpu_cores=[5], max_epochs=1)
    with pytest.raises(MisconfigurationError, match=r"names core 5 \(device xla:4\).*1 device"):
        trainer.fit(Net(), DataLoader(dataset(), batch_size=BATCH))


def test_a_checkpoint_round_trips(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    straight = copy.deepcopy(model)
    first = fit_on_xla(model, max_epochs=1)
    path = tmp_path / "epoch1.ckpt"
    first.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    assert {t.device.type for t in saved["state_dict"].values()} == {"cpu"}
    assert (saved["epoch"], saved["global_step"]) == (1, len(dataset()) // BATCH)
    for name, value in model.state_dict().items():
        assert torch.equal(saved["state_dict"][name], value.cpu())
    # Resume into a fresh model: the second epoch continues where the first stopped.
    torch.manual_seed(1)
    resumed = Net()
    second = Trainer(tpu_cores=1, max_epochs=2, resume_from_checkpoint=path)
    second.fit(resumed, DataLoader(dataset(), batch_size=BATCH, shuffle=True))
    fit_on_xla(straight, max_epochs=2)
    difference = max_difference(resumed, straight)
    print(f"resumed vs uninterrupted: max |difference| = {difference:.3g}")
    assert difference < TOLERANCE
    assert second.global_step == 2 * len(dataset()) // BATCH


def test_bf16_autocasts_on_the_xla_device() -> None:
    dtypes: list[torch.dtype] = []

    class Recording(Net):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            dtypes.append(self(batch[0]).dtype)
            return super().training_step(batch, batch_idx)

    torch.manual_seed(0)
    model = Recording()
    trainer = fit_on_xla(model, precision="bf16", max_epochs=1)
    assert set(dtypes) == {torch.bfloat16}
    assert trainer.accelerator.precision.device_type == "xla"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert next(model.parameters()).dtype == torch.float32  # autocast, not a cast


def test_precision_16_is_refused_before_training() -> None:
    with pytest.raises(MisconfigurationError, match="precision='bf16'"):
        Trainer(tpu_cores=1, precision=16)


def test_validation_and_test_run_on_the_device() -> None:
    torch.manual_seed(0)
    model = Net()
    trainer = fit_on_xla(model, max_epochs=1)
    loader = DataLoader(dataset(), batch_size=BATCH)
    metrics = trainer.validate(model, loader)
    x, y = dataset().tensors
    expected = torch.nn.functional.mse_loss(model.cpu()(x), y).item()
    assert metrics[0]["val_loss"] == pytest.approx(expected, abs=1e-5)


def test_cardcage_plugins_shows_it_available() -> None:
    env = {**os.environ, "PJRT_DEVICE": "CPU", **ONLY_TPU}
    result = subprocess.run(
        [sys.executable, "-m", "cardcage", "plugins", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)["backends"]
    assert (row["name"], row["available"]) == ("tpu", True), row
    assert row["reason"] == "XLA device type CPU (PJRT_DEVICE)"
