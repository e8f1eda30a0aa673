"""``cardcage.Trainer`` on the CPU against a plain PyTorch loop, from the same seed.

The reference loop is the one a user would write (``for batch in loader: opt.zero_grad();
loss = ...; loss.backward(); opt.step()``); on the CPU the Trainer's weights must be
bit-equal to it.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage
from cardcage import MisconfigurationError

F = torch.nn.functional
STEPS_PER_EPOCH = 8


def dataset(seed: int = 3, samples: int = 8 * STEPS_PER_EPOCH) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 4, generator=generator)
    return TensorDataset(x, (x[:, :1] - 2 * x[:, 1:2]).tanh())


def loader(shuffle: bool = False, seed: int = 3) -> DataLoader[Any]:
    return DataLoader(dataset(seed), batch_size=8, shuffle=shuffle)


class MLP(torch.nn.Module):
    """A small regression MLP trained with momentum SGD."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 16),
            torch.nn.Tanh(),
            torch.nn.Dropout(dropout),
            torch.nn.Linear(16, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.loss(batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def seeded(cls: Callable[..., torch.nn.Module] = MLP, **kwargs: Any) -> Any:
    torch.manual_seed(0)
    return cls(**kwargs)


def plain_loop(
    model: MLP, data: DataLoader[Any], epochs: int, max_steps: int | None = None
) -> list[float]:
    """The hand-written loop; returns every step's loss."""
    optimizer = model.configure_optimizers()
    losses: list[float] = []
    for _ in range(epochs):
        for batch in data:
            optimizer.zero_grad()
            loss = model.loss(batch)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if len(losses) == max_steps:
                return losses
    return losses


def assert_equal_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def fit(model: torch.nn.Module, *args: Any, **flags: Any) -> cardcage.Trainer:
    flags.setdefault("progress_bar", False)
    trainer = cardcage.Trainer(**flags)
    trainer.fit(model, *args)
    return trainer


# -- numerical parity -------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True])
def test_two_epochs_equal_a_plain_loop(shuffle: bool) -> None:
    model = seeded()
    trainer = fit(model, loader(shuffle), max_epochs=2)
    reference = seeded()
    expected_losses = plain_loop(reference, loader(shuffle), epochs=2)

    assert trainer.selection.accelerator == "cpu"
    assert_equal_weights(model, reference)
    assert trainer.global_step == 2 * STEPS_PER_EPOCH
    assert trainer.current_epoch == 2
    # One float per step, equal to what the plain loop computed; the last is logged.
    assert trainer.losses == expected_losses
    assert all(type(v) is float for v in trainer.losses)
    assert trainer.logged_metrics["loss"] == expected_losses[-1]
    # And training did something: the second epoch's mean loss is lower.
    assert sum(expected_losses[STEPS_PER_EPOCH:]) < sum(expected_losses[:STEPS_PER_EPOCH])


def test_the_weights_really_differ_between_shuffled_and_ordered_data() -> None:
    """The parity checks above could not pass by accident: the data order matters."""
    ordered, shuffled = seeded(), seeded()
    fit(ordered, loader(False), max_epochs=2)
    fit(shuffled, loader(True), max_epochs=2)
    assert not torch.equal(ordered.net[0].weight, shuffled.net[0].weight)


class Validated(MLP):
    """Dropout while training, validation metrics, and a record of how validation ran."""

    def __init__(self) -> None:
        super().__init__(dropout=0.3)
        self.validation_modes: list[bool] = []

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        self.validation_modes.append(self.training or torch.is_grad_enabled())
        torch.rand(3)  # random draws here must not change training
        return {"loss": self.loss(batch), "mae": (self(batch[0]) - batch[1]).abs().mean()}


def plain_validation(model: MLP, data: DataLoader[Any]) -> dict[str, float]:
    model.eval()
    with torch.no_grad():
        outputs = [(float(model.loss(b)), float((model(b[0]) - b[1]).abs().mean())) for b in data]
    model.train()
    return {
        "val_loss": sum(o[0] for o in outputs) / len(outputs),
        "val_mae": sum(o[1] for o in outputs) / len(outputs),
    }


@pytest.mark.parametrize("shuffle", [False, True])
def test_validation_between_epochs_changes_nothing(shuffle: bool) -> None:
    model = seeded(Validated)
    trainer = fit(model, loader(shuffle), loader(seed=4), max_epochs=2)
    reference = seeded(Validated)
    expected_losses = plain_loop(reference, loader(shuffle), epochs=2)

    assert_equal_weights(model, reference)
    assert trainer.losses == expected_losses
    # Validation ran after each epoch, in eval mode without gradients...
    assert model.validation_modes == [False] * 2 * STEPS_PER_EPOCH
    assert model.training
    # ... and its mean metrics of the last epoch are logged next to the loss.
    expected = plain_validation(reference, loader(seed=4))
    for key, value in expected.items():
        assert trainer.logged_metrics[key] == pytest.approx(value, rel=1e-6)
    assert trainer.logged_metrics["loss"] == expected_losses[-1]


@pytest.mark.parametrize(("max_epochs", "max_steps"), [(2, 5), (3, 13), (None, 11)])
def test_max_steps_stops_mid_epoch(max_epochs: int | None, max_steps: int) -> None:
    model = seeded()
    trainer = fit(model, loader(True), max_epochs=max_epochs, max_steps=max_steps)
    reference = seeded()
    expected_losses = plain_loop(reference, loader(True), epochs=3, max_steps=max_steps)

    assert trainer.global_step == max_steps
    assert len(trainer.losses) == max_steps
    assert trainer.losses == expected_losses
    assert_equal_weights(model, reference)


def test_max_epochs_wins_over_a_larger_max_steps() -> None:
    trainer = fit(seeded(), loader(), max_epochs=1, max_steps=100)
    assert trainer.global_step == STEPS_PER_EPOCH


class DictLoss(MLP):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = self.loss(batch)
        return {"loss": loss, "log": {"anything": loss.detach()}}


def test_a_dict_holding_the_loss_trains_the_same() -> None:
    model = seeded(DictLoss)
    trainer = fit(model, loader(True), max_epochs=2)
    reference = seeded()
    assert trainer.losses == plain_loop(reference, loader(True), epochs=2)
    assert_equal_weights(model, reference)


class TwoHeads(torch.nn.Module):
    """Two parts with one optimizer each; loss 0 depends on both parts."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 8)
        self.head = torch.nn.Linear(8, 1)
        self.calls: list[int | None] = []

    def losses(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        out = self.head(torch.tanh(self.body(x)))
        return F.mse_loss(out, y), F.l1_loss(out, y) + 0.01 * self.head.weight.pow(2).sum()

    def configure_optimizers(self) -> Any:
        return [
            torch.optim.SGD(self.body.parameters(), lr=0.1, momentum=0.9),
            torch.optim.Adam(self.head.parameters(), lr=0.01),
        ]


class PerOptimizer(TwoHeads):
    def training_step(self, batch: Any, batch_idx: int, optimizer_idx: int) -> torch.Tensor:
        self.calls.append(optimizer_idx)
        return self.losses(batch)[optimizer_idx]


class OneBackward(TwoHeads):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls.append(None)
        first, second = self.losses(batch)
        return first + second


def test_several_optimizers_with_optimizer_idx_step_one_after_the_other() -> None:
    model = seeded(PerOptimizer)
    trainer = fit(model, loader(True), max_epochs=2)
    assert model.calls == [0, 1] * 2 * STEPS_PER_EPOCH

    reference = seeded(TwoHeads)
    optimizers = reference.configure_optimizers()
    expected_losses = []
    for _ in range(2):
        for batch in loader(True):
            for index, optimizer in enumerate(optimizers):
                optimizer.zero_grad()
                loss = reference.losses(batch)[index]
                loss.backward()
                optimizer.step()
            expected_losses.append(loss.item())  # the last optimizer's loss is recorded
    assert_equal_weights(model, reference)
    assert trainer.losses == expected_losses


def test_several_optimizers_without_optimizer_idx_all_step_after_one_backward() -> None:
    model = seeded(OneBackward)
    trainer = fit(model, loader(True), max_epochs=2)
    assert model.calls == [None] * 2 * STEPS_PER_EPOCH

    reference = seeded(TwoHeads)
    optimizers = reference.configure_optimizers()
    expected_losses = []
    for _ in range(2):
        for batch in loader(True):
            for optimizer in optimizers:
                optimizer.zero_grad()
            loss = sum(reference.losses(batch))
            loss.backward()
            for optimizer in optimizers:
                optimizer.step()
            expected_losses.append(loss.item())
    assert_equal_weights(model, reference)
    assert trainer.losses == expected_losses


class Scheduled(MLP):
    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


def test_a_step_lr_scheduler_steps_once_per_epoch() -> None:
    model = seeded(Scheduled)
    trainer = fit(model, loader(True), max_epochs=3)

    reference = seeded(MLP)
    optimizer = reference.configure_optimizers()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for _ in range(3):
        for batch in loader(True):
            optimizer.zero_grad()
            reference.loss(batch).backward()
            optimizer.step()
        scheduler.step()
    assert_equal_weights(model, reference)
    assert trainer.optimization.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 / 8)
    assert len(trainer.optimization.schedulers) == 1


class WithLoaders(Validated):
    def train_dataloader(self) -> DataLoader[Any]:
        return loader(True)

    def val_dataloader(self) -> DataLoader[Any]:
        return loader(seed=4)


def test_dataloaders_from_the_model() -> None:
    model = seeded(WithLoaders)
    trainer = cardcage.Trainer(max_epochs=2, progress_bar=False)
    trainer.fit(model)
    reference = seeded(Validated)
    expected_losses = plain_loop(reference, loader(True), epochs=2)
    assert_equal_weights(model, reference)
    assert trainer.losses == expected_losses
    assert len(model.validation_modes) == 2 * STEPS_PER_EPOCH
    assert trainer.logged_metrics["val_loss"] == pytest.approx(
        plain_validation(reference, loader(seed=4))["val_loss"], rel=1e-6
    )


def test_an_argument_loader_wins_over_the_models_method() -> None:
    model = seeded(WithLoaders)
    fit(model, loader(False), max_epochs=1)
    reference = seeded(Validated)
    plain_loop(reference, loader(False), epochs=1)
    assert_equal_weights(model, reference)


# -- validate() and test() --------------------------------------------------------------------


class Evaluated(MLP):
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def test_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {
            "loss": self.loss(batch),
            "acc": ((self(x) > 0) == (y > 0)).float().mean(),
            "not_a_scalar": x,
        }


def test_validate_and_test_return_mean_metrics() -> None:
    model = seeded(Evaluated)
    trainer = fit(model, loader(), max_epochs=1)
    data = [loader(seed=5), loader(seed=6)]

    model.eval()
    with torch.no_grad():
        losses = [float(model.loss(b)) for d in data for b in d]
        accs = [float(((model(b[0]) > 0) == (b[1] > 0)).float().mean()) for d in data for b in d]
    model.train()

    val = trainer.validate(dataloaders=data)
    per = len(losses) // 2  # each loader's batches
    assert val == [
        {"val_loss/dataloader_idx_0": pytest.approx(sum(losses[:per]) / per, rel=1e-6)},
        {"val_loss/dataloader_idx_1": pytest.approx(sum(losses[per:]) / per, rel=1e-6)},
    ]
    test = trainer.test(model, data)
    assert [set(d) for d in test] == [
        {"test_loss/dataloader_idx_0", "test_acc/dataloader_idx_0"},
        {"test_loss/dataloader_idx_1", "test_acc/dataloader_idx_1"},
    ]
    # the means over both loaders: what the logger got, and what test() returned before
    assert trainer.logged_metrics["test_loss"] == pytest.approx(sum(losses) / len(losses))
    assert trainer.logged_metrics["test_acc"] == pytest.approx(sum(accs) / len(accs), rel=1e-6)
    with pytest.warns(DeprecationWarning, match=r"list of dicts, one per dataloader"):
        assert test["test_acc"] == trainer.logged_metrics["test_acc"]
    with pytest.warns(DeprecationWarning):
        assert test.keys() == {"test_loss", "test_acc"}
    with pytest.warns(DeprecationWarning):
        assert val == {"val_loss": pytest.approx(sum(losses) / len(losses), rel=1e-6)}
    assert model.training  # evaluation put the model back


def test_validate_without_fit_and_its_errors() -> None:
    trainer = cardcage.Trainer(progress_bar=False)
    model = seeded(Evaluated)
    assert [set(d) for d in trainer.validate(model, loader())] == [{"val_loss"}]
    with pytest.raises(MisconfigurationError, match="no dataloader"):
        trainer.validate(model)
    with pytest.raises(MisconfigurationError, match="test_step"):
        trainer.test(seeded(MLP), loader())


# -- what the model must be -------------------------------------------------------------------


class NoStep(torch.nn.Module):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


class NoOptimizers(torch.nn.Module):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.zeros(())


class Returns(MLP):
    def __init__(self, output: Any = None, optimizers: Any = None):
        super().__init__()
        self.output = output
        self.optimizers = optimizers

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.output

    def configure_optimizers(self) -> Any:
        return self.optimizers if self.optimizers is not None else super().configure_optimizers()


@pytest.mark.parametrize(
    ("model", "match"),
    [
        (NoStep(), r"NoStep has no training_step"),
        (NoOptimizers(), r"NoOptimizers has no configure_optimizers"),
        (lambda batch: batch, r"function is not a torch\.nn\.Module"),
        (Returns(output=1.5), r"training_step returned float; return a loss tensor"),
        (Returns(output={"los": torch.ones(())}), r"training_step returned dict"),
        (Returns(output=None), r"training_step returned NoneType"),
        (Returns(optimizers="adam"), r"configure_optimizers\(\) of Returns returned 'adam'"),
        (Returns(optimizers=[]), r"configure_optimizers\(\) of Returns returned \[\]"),
        (Returns(optimizers=([], [])), r"configure_optimizers\(\) of Returns returned"),
        (Returns(optimizers={"lr_scheduler": None}), r"configure_optimizers\(\)"),
    ],
    ids=[
        "no-training-step",
        "no-configure-optimizers",
        "not-a-module",
        "float-loss",
        "dict-without-loss",
        "none-loss",
        "string-optimizer",
        "no-optimizer",
        "empty-pair",
        "dict-without-optimizer",
    ],
)
def test_a_model_that_cannot_train_is_refused(model: Any, match: str) -> None:
    with pytest.raises(MisconfigurationError, match=match):
        fit(model, loader())


def test_fit_without_any_train_dataloader_is_refused() -> None:
    with pytest.raises(MisconfigurationError, match="train_dataloader"):
        cardcage.Trainer().fit(seeded())


def test_bad_trainer_flags_fail_in_the_constructor() -> None:
    with pytest.raises(MisconfigurationError, match="progress_bar"):
        cardcage.Trainer(progress_bar="yes")


# -- side effects -----------------------------------------------------------------------------


def tree(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(path.relative_to(root)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in root.rglob("*")
    }


def test_fit_writes_no_file_without_default_root_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "user_file.txt").write_text("mine")
    monkeypatch.chdir(tmp_path)
    before = tree(tmp_path)
    model = seeded(Validated)
    trainer = cardcage.Trainer(max_epochs=2, default_root_dir=None)
    trainer.fit(model, loader(True), loader(seed=4))
    trainer.validate(model, loader(seed=4))
    assert trainer.global_step == 2 * STEPS_PER_EPOCH
    assert tree(tmp_path) == before


DEMO = textwrap.dedent(
    """
    import runpy, sys
    import torch

    # The user's thread settings, made before anything runs in parallel.
    torch.set_num_interop_threads(1)
    torch.set_num_threads(1)
    sys.argv = ["cardcage", "demo", *sys.argv[1:]]
    try:
        runpy.run_module("cardcage", run_name="__main__", alter_sys=True)  # python -m cardcage
    except SystemExit as exit:
        code = exit.code
    print("exit", code, "threads", torch.get_num_threads(), torch.get_num_interop_threads())
    """
)


def test_a_single_process_run_leaves_thread_settings_alone(
    launched: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    """The demo trained in one process on the CPU, with the thread counts its user set."""
    result = launched["demo"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "exit 0 threads 1 1"


def test_thread_settings_unchanged_in_process() -> None:
    threads = torch.get_num_threads()
    interop = torch.get_num_interop_threads()
    fit(seeded(), loader(), max_epochs=1)
    assert (torch.get_num_threads(), torch.get_num_interop_threads()) == (threads, interop)


# -- the progress bar -------------------------------------------------------------------------


def test_progress_bar_shows_steps_and_loss(capsys: pytest.CaptureFixture[str]) -> None:
    model = seeded(Validated)
    trainer = fit(model, loader(), loader(seed=4), max_epochs=2, progress_bar=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.replace("\r", "\n")
    assert "epoch 0" in err and "epoch 1" in err
    assert f"{STEPS_PER_EPOCH}/{STEPS_PER_EPOCH}" in err
    final = [line for line in err.splitlines() if line.startswith("epoch 1") and "loss=" in line]
    assert final, err
    assert f"loss={trainer.losses[-1]:.4g}" in final[-1]
    assert "val_loss=" in final[-1]


def test_progress_bar_counts_every_sample_the_short_last_batch_included(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """samples/s reads batch sizes only when the bar redraws and at the epoch's end, yet
    counts each sample once: 10 samples in batches of 4, 4 and 2 over one second is 10/s."""
    from cardcage.train import progress

    clock = iter([0.0, 1.0])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    out = io.StringIO()
    bar = progress.ProgressBar(True, file=out)
    bar.start_epoch(0, 3)
    for size in (4, 4, 2):
        bar.step(0.5, [torch.zeros(size, 3), torch.zeros(size)])
    bar.end_epoch()
    assert "samples_s=10," in out.getvalue() or "samples_s=10]" in out.getvalue(), out.getvalue()


def test_progress_bar_is_called_only_when_tqdm_would_look_at_its_clock(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between redraws tqdm skips ``miniters`` updates; the loop skips the calls too, yet the
    bar counts every step, and a fit starts no thread of tqdm's (its monitor)."""
    import threading

    from cardcage.train import progress

    calls: list[int] = []
    step = progress.ProgressBar.step

    def counted(self: progress.ProgressBar, loss: Any, batch: Any, steps: int = 1) -> int:
        calls.append(steps)
        return step(self, loss, batch, steps)

    monkeypatch.setattr(progress.ProgressBar, "step", counted)
    before = set(threading.enumerate())
    steps = 3000
    data = DataLoader(TensorDataset(torch.randn(steps, 4), torch.zeros(steps, 1)), batch_size=1)
    torch.manual_seed(0)
    fit(MLP(), data, max_epochs=1, progress_bar=True)
    err = capsys.readouterr().err
    assert f"{steps}/{steps}" in err, err
    assert sum(calls) == steps
    assert len(calls) < steps / 2, f"{len(calls)} calls for {steps} steps"
    assert not [
        t for t in set(threading.enumerate()) - before if "monitor" in type(t).__name__.lower()
    ]


def test_progress_bar_keeps_its_pace_from_one_epoch_to_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each epoch has a new tqdm bar, which starts not knowing how many steps pass between
    redraws and so looks at its clock every step until it first redraws (a third of the
    benchmark MLP's 500-step epoch). The next epoch's bar starts at the pace the last one
    learned: the loop calls it about once per redraw from its first step on."""
    import tqdm.std

    from cardcage.train import progress

    now = [0.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: now[0])  # 1 ms a step, 100 per redraw
    bar = progress.ProgressBar(True, file=io.StringIO())
    batch = [torch.zeros(2, 3)]

    def epoch(index: int, steps: int = 1000) -> int:
        """The loop's countdown (loop.py) over one epoch; the calls it makes."""
        calls, unshown = 0, 0
        due = bar.start_epoch(index, steps)
        for _ in range(steps):
            now[0] += 0.001
            unshown += 1
            if unshown >= due:
                due, unshown, calls = bar.step(0.5, batch, unshown), 0, calls + 1
        if unshown:
            bar.step(0.5, batch, unshown)
        bar.end_epoch()
        return calls

    first, second, third = epoch(0), epoch(1), epoch(2)
    assert first >= 100, first  # a call a step until the first redraw, 0.1 s in
    assert second <= 30 and third <= 30, (second, third)  # about one per redraw (0.1 s)


def test_progress_bar_off(capsys: pytest.CaptureFixture[str]) -> None:
    fit(seeded(), loader(), max_epochs=1, progress_bar=False)
    assert capsys.readouterr().err == ""


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_default_follows_whether_stderr_is_a_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fit(seeded(), loader(), max_epochs=1, progress_bar=None)
    assert capsys.readouterr().err == ""  # captured stderr is not a terminal

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    fit(seeded(), loader(), max_epochs=1, progress_bar=None)
    assert f"{STEPS_PER_EPOCH}/{STEPS_PER_EPOCH}" in terminal.getvalue()
    assert "loss=" in terminal.getvalue()


# -- cardcage demo, and the processes this module starts -------------------------------------

COMMANDS = {
    "demo": ["-c", DEMO, "--max-epochs", "2"],
    "demo_fp16": ["-m", "cardcage", "demo", "--precision", "16"],
    "demo_gpus": ["-m", "cardcage", "demo", "--gpus", "2"],
}


@pytest.fixture(scope="module")
def launched() -> Iterator[dict[str, subprocess.CompletedProcess[str]]]:
    """Every subprocess of this module, started together (each pays for importing torch)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    running = {
        name: subprocess.Popen(
            [sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name, args in COMMANDS.items()
    }
    results = {}
    try:
        for name, process in running.items():
            out, err = process.communicate(timeout=300)
            results[name] = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    finally:
        for process in running.values():
            process.kill()
    yield results


def test_demo_prints_the_selection_first_and_trains(
    launched: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    result = launched["demo"]
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("cardcage: training on 'cpu'"), result.stdout
    assert "cpu_fallback" in lines[0]
    assert "trained 2 epoch(s), 64 steps" in lines[-2]
    assert "val_acc" in lines[-2]
    # The progress bar went to stderr, with the loss.
    assert "loss=" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("name", "message"), [("demo_fp16", "precision=16"), ("demo_gpus", "gpus=2")]
)
def test_demo_with_a_bad_flag_exits_2_without_a_traceback(
    launched: dict[str, subprocess.CompletedProcess[str]], name: str, message: str
) -> None:
    result = launched[name]
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("cardcage: error: ")
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_demo_trains_in_bf16(capsys: pytest.CaptureFixture[str]) -> None:
    from cardcage.cli import main as cli

    assert cli.main(["demo", "--precision", "bf16", "--max-epochs", "1", "--no-progress-bar"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].startswith("cardcage: training on 'cpu'")
    assert "trained 1 epoch(s), 32 steps" in lines[-1]
    assert captured.err == ""


class ClippedMLP(MLP):
    """Clips its gradients in ``on_after_backward``, as the model contract allows."""

    def on_after_backward(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm=0.05)


def test_on_after_backward_clips_before_the_optimizer_step() -> None:
    model = seeded(ClippedMLP)
    fit(model, loader(shuffle=True), max_epochs=2)
    reference = seeded(ClippedMLP)
    optimizer = reference.configure_optimizers()
    for _ in range(2):
        for batch in loader(shuffle=True):
            optimizer.zero_grad()
            reference.loss(batch).backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.05)
            optimizer.step()
    assert_equal_weights(model, reference)
    unclipped = seeded()
    fit(unclipped, loader(shuffle=True), max_epochs=2)
    assert not torch.equal(unclipped.net[0].weight, model.net[0].weight)  # the clip mattered
