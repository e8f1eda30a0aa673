"""The gpu and dp backends on real CUDA devices (run by scripts/gpu-tests.sh).

Every test is marked ``gpu``; ``tests/gpu/conftest.py`` skips them where CUDA is not
available. Parity is checked against the plain CUDA loop a user would write.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage
from cardcage.checkpoints import io as checkpoint

F = torch.nn.functional
BATCH = 32
STEPS_PER_EPOCH = 4


def loader(shuffle: bool = True, seed: int = 5) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH * STEPS_PER_EPOCH, 8, generator=generator)
    labels = (x[:, 0] - x[:, 1] > 0).long() + (x[:, 2] > 0.5).long()
    return DataLoader(TensorDataset(x, labels), batch_size=BATCH, shuffle=shuffle)


class Classifier(torch.nn.Module):
    """An MLP classifier that records autocast, dtypes and ``*_step_end`` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3)
        )
        self.seen: list[tuple[bool, torch.dtype, str]] = []
        self.step_end_shapes: list[tuple[int, ...]] = []
        self.use_step_end = False

    def loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self.net(x)
        return F.cross_entropy(logits, y), logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, logits = self.loss(batch)
        self.seen.append((torch.is_autocast_enabled("cuda"), logits.dtype, batch[0].device.type))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        loss, logits = self.loss(batch)
        return {"loss": loss, "acc": (logits.argmax(dim=1) == batch[1]).float().mean()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class WithStepEnd(Classifier):
    """Reduces what the DataParallel replicas returned itself, as Lightning 1.0 allowed."""

    def training_step_end(self, outputs: torch.Tensor) -> torch.Tensor:
        self.step_end_shapes.append(tuple(outputs.shape))
        return outputs.mean()


def seeded(cls: Callable[[], Classifier] = Classifier) -> Any:
    torch.manual_seed(0)
    return cls()


def plain_cuda_loop(model: Classifier, epochs: int, device: torch.device) -> list[float]:
    model.to(device)
    optimizer = model.configure_optimizers()
    losses = []
    for _ in range(epochs):
        for x, y in loader():
            optimizer.zero_grad()
            loss = model.loss((x.to(device), y.to(device)))[0]
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses


def assert_close_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (key, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=key)


def epoch_means(losses: list[float]) -> list[float]:
    return [
        sum(losses[i : i + STEPS_PER_EPOCH]) / STEPS_PER_EPOCH
        for i in range(0, len(losses), STEPS_PER_EPOCH)
    ]


def fit(model: torch.nn.Module, *loaders: Any, **flags: Any) -> cardcage.Trainer:
    flags.setdefault("progress_bar", False)
    trainer = cardcage.Trainer(**flags)
    trainer.fit(model, *loaders)
    return trainer


# -- gpu --------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_backend_matches_a_plain_cuda_loop() -> None:
    model = seeded()
    trainer = fit(model, loader(), max_epochs=2, gpus=1)
    assert trainer.selection.accelerator == "gpu"
    assert trainer.accelerator.device == torch.device("cuda", 0)
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert {seen[2] for seen in model.seen} == {"cuda"}  # batches were moved

    reference = seeded()
    expected = plain_cuda_loop(reference, 2, torch.device("cuda", 0))
    assert_close_weights(model, reference)
    assert trainer.losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert epoch_means(trainer.losses)[-1] < epoch_means(trainer.losses)[0]


@pytest.mark.gpu
def test_gpu_checkpoint_resumes_mid_epoch_and_loads_on_the_cpu(tmp_path: Path) -> None:
    straight = seeded()
    fit(straight, loader(), max_epochs=2, gpus=1)

    first = fit(seeded(), loader(), max_epochs=2, max_steps=3, gpus=1)
    first.save_checkpoint(tmp_path / "gpu.ckpt")
    state = checkpoint.load(tmp_path / "gpu.ckpt")
    assert all(t.device.type == "cpu" for t in state["state_dict"].values())
    assert "cuda" in state["rng"]

    torch.manual_seed(123)
    resumed = Classifier()
    trainer = fit(
        resumed, loader(), max_epochs=2, gpus=1, resume_from_checkpoint=tmp_path / "gpu.ckpt"
    )
    assert trainer.global_step == 2 * STEPS_PER_EPOCH
    assert_close_weights(resumed, straight)


@pytest.mark.gpu
def test_bf16_on_the_gpu() -> None:
    if not torch.cuda.is_bf16_supported():
        with pytest.raises(cardcage.MisconfigurationError, match="bf16"):
            fit(seeded(), loader(), gpus=1, precision="bf16")
        return
    model = seeded()
    trainer = fit(model, loader(), loader(False, seed=6), max_epochs=4, gpus=1, precision="bf16")
    assert trainer.accelerator.precision.scaler is None
    assert model.seen and all(seen[:2] == (True, torch.bfloat16) for seen in model.seen)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.isfinite(torch.tensor(trainer.losses)))
    assert epoch_means(trainer.losses)[-1] < epoch_means(trainer.losses)[0]
    assert "val_acc" in trainer.logged_metrics


@pytest.mark.gpu
def test_precision_64_on_the_gpu() -> None:
    model = seeded()
    fit(model, loader(), gpus=1, precision=64)
    assert all(p.dtype == torch.float64 and p.is_cuda for p in model.parameters())
    assert all(seen[1] == torch.float64 for seen in model.seen)


class RecordsBenchmark(Classifier):
    """Records the cudnn flag each training step runs with."""

    def __init__(self) -> None:
        super().__init__()
        self.benchmarks: set[bool] = set()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.benchmarks.add(torch.backends.cudnn.benchmark)
        return super().training_step(batch, batch_idx)


@pytest.mark.gpu
def test_benchmark_is_on_while_training_and_the_caller_gets_its_value_back() -> None:
    model = seeded(RecordsBenchmark)
    fit(model, loader(), gpus=1)
    assert model.benchmarks == {False}
    model = seeded(RecordsBenchmark)
    fit(model, loader(), gpus=1, benchmark=True)
    assert model.benchmarks == {True}
    assert torch.backends.cudnn.benchmark is False  # the fit put the caller's value back


# -- dp ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("gpus", [1, -1], ids=["one-gpu", "all-gpus"])
def test_dp_reduces_replica_outputs_with_training_step_end(gpus: int) -> None:
    count = 1 if gpus == 1 else torch.cuda.device_count()
    model = seeded(WithStepEnd)
    trainer = fit(
        model, loader(), loader(False, seed=6), max_epochs=4, gpus=gpus, distributed_backend="dp"
    )
    assert trainer.selection.accelerator == "dp"
    assert trainer.selection.gpu_ids == list(range(count))
    # One training_step_end call per step, with one loss per replica (a scalar on one GPU).
    assert model.step_end_shapes == [(count,) if count > 1 else ()] * 4 * STEPS_PER_EPOCH
    assert len(model.seen) == 4 * STEPS_PER_EPOCH * count  # every replica ran the step
    assert all(seen[2] == "cuda" for seen in model.seen)
    assert epoch_means(trainer.losses)[-1] < epoch_means(trainer.losses)[0]
    assert {"val_loss", "val_acc"} <= trainer.logged_metrics.keys()
    assert next(model.parameters()).device == torch.device("cuda", 0)


@pytest.mark.gpu
def test_dp_on_one_gpu_matches_a_plain_cuda_loop() -> None:
    model = seeded()
    trainer = fit(model, loader(), max_epochs=2, gpus=1, distributed_backend="dp")
    reference = seeded()
    expected = plain_cuda_loop(reference, 2, torch.device("cuda", 0))
    assert_close_weights(model, reference)
    assert trainer.losses == pytest.approx(expected, rel=1e-5, abs=1e-6)


@pytest.mark.gpu
def test_dp_without_step_end_averages_the_replicas() -> None:
    model = seeded()
    trainer = fit(model, loader(), max_epochs=2, gpus=-1, distributed_backend="dp")
    assert len(trainer.losses) == 2 * STEPS_PER_EPOCH
    assert epoch_means(trainer.losses)[-1] < epoch_means(trainer.losses)[0]


@pytest.mark.gpu
def test_dp_with_batches_that_split_unevenly_matches_a_plain_cuda_loop() -> None:
    """Batches of one more sample than there are GPUs (3 on 2 GPUs: 2 + 1): each replica's
    loss counts by its share of the batch, so the steps are the plain loop's."""
    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip("needs two GPUs")
    data = loader(False).dataset
    uneven = DataLoader(data, batch_size=count + 1, shuffle=False)
    model = seeded()
    fit(model, uneven, max_steps=12, gpus=-1, distributed_backend="dp")
    reference = seeded()
    device = torch.device("cuda", 0)
    reference.to(device)
    optimizer = reference.configure_optimizers()
    for _, (x, y) in zip(range(12), uneven, strict=False):
        optimizer.zero_grad()
        reference.loss((x.to(device), y.to(device)))[0].backward()
        optimizer.step()
    assert_close_weights(model, reference)


# -- 16-bit -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(("backend", "gpus"), [("gpu", 1), ("dp", -1)])
def test_precision_16_uses_autocast_and_a_grad_scaler(
    backend: str, gpus: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    scaled: list[float] = []
    original = torch.amp.GradScaler.scale

    def scale(self: torch.amp.GradScaler, outputs: Any) -> Any:
        scaled.append(float(outputs.detach()))
        return original(self, outputs)

    monkeypatch.setattr(torch.amp.GradScaler, "scale", scale)
    model = seeded()
    trainer = fit(
        model, loader(), max_epochs=6, gpus=gpus, distributed_backend=backend, precision=16
    )
    assert trainer.selection.accelerator == backend
    scaler = trainer.accelerator.precision.scaler
    assert isinstance(scaler, torch.amp.GradScaler)
    assert scaler.is_enabled() and scaler.get_scale() > 0
    assert len(scaled) == 6 * STEPS_PER_EPOCH  # every step's loss went through the scaler
    assert model.seen and all(seen[:2] == (True, torch.float16) for seen in model.seen)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.isfinite(torch.tensor(trainer.losses)))
    assert epoch_means(trainer.losses)[-1] < epoch_means(trainer.losses)[0]
    assert not torch.is_autocast_enabled("cuda")


# -- log_gpu_memory ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(("backend", "gpus"), [("gpu", 1), ("dp", -1)])
def test_log_gpu_memory(backend: str, gpus: int) -> None:
    trainer = fit(seeded(), loader(), gpus=gpus, distributed_backend=backend, log_gpu_memory="all")
    ids = trainer.selection.gpu_ids
    assert ids
    keys = {f"gpu_{i}_memory_mb" for i in ids}
    assert keys <= trainer.logged_metrics.keys()
    assert trainer.logged_metrics[f"gpu_{ids[0]}_memory_mb"] > 0  # the model lives there

    trainer = fit(
        seeded(), loader(), gpus=gpus, distributed_backend=backend, log_gpu_memory="min_max"
    )
    metrics = trainer.logged_metrics
    assert {"gpu_memory_min_mb", "gpu_memory_max_mb"} <= metrics.keys()
    assert 0 <= metrics["gpu_memory_min_mb"] <= metrics["gpu_memory_max_mb"]
    assert metrics["gpu_memory_max_mb"] > 0
    assert f"gpu_{ids[0]}_memory_mb" not in metrics  # min_max logs only the extremes


@pytest.mark.gpu
def test_no_gpu_memory_metrics_unless_asked() -> None:
    trainer = fit(seeded(), loader(), gpus=1)
    assert not any("memory" in key for key in trainer.logged_metrics)


# -- fsdp -------------------------------------------------------------------------------------
# One process (a world of one over NCCL) in this process; two GPUs through fsdp_spawn.


@pytest.mark.gpu
def test_fsdp_on_one_gpu_matches_a_plain_cuda_loop() -> None:
    model = seeded()
    trainer = fit(model, loader(False), max_epochs=2, gpus=1, distributed_backend="fsdp")
    assert trainer.selection.accelerator == "fsdp"
    assert torch.distributed.get_backend() == "nccl"
    assert type(model) is Classifier
    assert all(type(p) is torch.nn.Parameter and p.is_cuda for p in model.parameters())
    reference = seeded()
    device = torch.device("cuda", 0)
    reference.to(device)
    optimizer = reference.configure_optimizers()
    for _ in range(2):
        for x, y in loader(False):
            optimizer.zero_grad()
            reference.loss((x.to(device), y.to(device)))[0].backward()
            optimizer.step()
    assert_close_weights(model, reference)


@pytest.mark.gpu
def test_fsdp_bf16_computes_in_bf16_and_keeps_fp32_weights() -> None:
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    model = seeded()
    trainer = fit(
        model, loader(), max_epochs=4, gpus=1, precision="bf16", distributed_backend="fsdp"
    )
    seen = trainer.accelerator.sharded.seen  # type: ignore[attr-defined]
    assert seen and all(s[1] == torch.bfloat16 for s in seen)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert epoch_means(trainer.losses)[-1] < epoch_means(trainer.losses)[0]


@pytest.mark.gpu
def test_fsdp_spawn_on_two_gpus_matches_one_process_of_the_double_batch() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    half = DataLoader(loader(False).dataset, batch_size=BATCH // 2, shuffle=False)
    model = seeded()
    fit(model, half, max_epochs=2, gpus=2, distributed_backend="fsdp_spawn")
    reference = seeded()
    plain_cuda_loop_unshuffled = [
        (x, y) for x, y in loader(False)
    ]  # one process sees the whole batch of BATCH
    device = torch.device("cuda", 0)
    reference.to(device)
    optimizer = reference.configure_optimizers()
    for _ in range(2):
        for x, y in plain_cuda_loop_unshuffled:
            optimizer.zero_grad()
            reference.loss((x.to(device), y.to(device)))[0].backward()
            optimizer.step()
    assert_close_weights(model.to(device), reference)
