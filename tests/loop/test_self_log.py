"""``self.log`` in one process: step rows every ``log_every_n_steps``, epoch means weighted by
batch size, forked ``_step``/``_epoch`` names, validation means, what ``callback_metrics`` and
``logged_metrics`` hold after fit, and the refusals. Every value is checked against a plain
PyTorch loop (or a mean computed by hand) over the same data and initial weights."""

from __future__ import annotations

import copy
import csv
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage
from cardcage.loggers import CSVLogger

LR = 0.05


def data(samples: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 3, generator=g)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.3)


class Logging(cardcage.Module):
    """Logs its training loss per step (``train_loss``), per epoch only (``epoch_loss``),
    both (``both``), and its validation loss (``val_loss``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        self.log("epoch_loss", loss, on_step=False, on_epoch=True)
        self.log("both", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def plain_losses(model: torch.nn.Module, loader: DataLoader[Any], epochs: int) -> list[list[Any]]:
    """The plain loop: per epoch, each step's (loss, batch size)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for _ in range(epochs):
        seen = []
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model.layer(x), y)  # type: ignore[operator]
            loss.backward()
            optimizer.step()
            seen.append((float(loss.detach()), len(x)))
        out.append(seen)
    return out


def weighted(pairs: list[tuple[float, int]]) -> float:
    return sum(v * n for v, n in pairs) / sum(n for _, n in pairs)


def rows(logger: CSVLogger) -> list[dict[str, str]]:
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as file:
        return list(csv.DictReader(file))


def run(tmp_path: Path, epochs: int, train_samples: int, batch: int, **flags: Any) -> Any:
    torch.manual_seed(0)
    model = Logging()
    reference = copy.deepcopy(model)
    train = DataLoader(data(train_samples, 1), batch_size=batch)
    val = DataLoader(data(10, 2), batch_size=4)  # sizes 4, 4, 2
    logger = CSVLogger(tmp_path)
    trainer = cardcage.Trainer(max_epochs=epochs, logger=logger, progress_bar=False, **flags)
    trainer.fit(model, train, val)
    return trainer, model, logger, plain_losses(reference, train, epochs), val


def test_step_values_are_written_every_log_every_n_steps(tmp_path: Path) -> None:
    """12 steps (2 epochs of 6), log_every_n_steps=3: rows at steps 2, 5, 8, 11, each with that
    step's loss exactly as the plain loop computed it."""
    trainer, _, logger, plain, _ = run(tmp_path, 2, 24, 4, log_every_n_steps=3)
    losses = [v for epoch in plain for v, _ in epoch]
    stepped = {int(r["step"]): float(r["train_loss"]) for r in rows(logger) if r["train_loss"]}
    assert stepped == {s: losses[s] for s in (2, 5, 8, 11)}
    forked = {int(r["step"]): float(r["both_step"]) for r in rows(logger) if r["both_step"]}
    assert forked == stepped
    assert trainer.global_step == 12


def test_step_values_not_yet_written_go_out_at_the_end_of_the_epoch(tmp_path: Path) -> None:
    """10 steps (2 epochs of 5), log_every_n_steps=2: step rows at 1, 3, 5, 7, 9, and the
    end of epoch 0 writes step 4's value too (docs/training-loop.md, "Logging": epoch means
    go out "with any step values not yet written"; Lightning 1.0 wrote none at step 4)."""
    _, _, logger, plain, _ = run(tmp_path, 2, 20, 4, log_every_n_steps=2)
    losses = [v for epoch in plain for v, _ in epoch]
    stepped = {int(r["step"]): float(r["train_loss"]) for r in rows(logger) if r["train_loss"]}
    assert stepped == {s: losses[s] for s in (1, 3, 4, 5, 7, 9)}


def test_epoch_means_are_weighted_by_batch_size(tmp_path: Path) -> None:
    """10 samples in batches of 4, 4, 2: the epoch value is sum(loss_i * n_i) / sum(n_i) of the
    plain loop's losses (an unweighted mean differs), in the CSV row of the epoch's last
    step, in logged_metrics and in callback_metrics."""
    trainer, _, logger, plain, _ = run(tmp_path, 2, 10, 4, log_every_n_steps=1)
    means = [weighted(epoch) for epoch in plain]
    unweighted = sum(v for v, _ in plain[-1]) / 3
    assert abs(unweighted - means[-1]) > 1e-3  # the data tells the two apart
    by_step = {int(r["step"]): r for r in rows(logger)}
    for epoch, mean in enumerate(means):
        row = by_step[3 * epoch + 2]
        assert float(row["epoch_loss"]) == pytest.approx(mean, rel=1e-6)
        assert float(row["both_epoch"]) == pytest.approx(mean, rel=1e-6)
    assert trainer.logged_metrics["epoch_loss"] == pytest.approx(means[-1], rel=1e-6)
    assert float(trainer.callback_metrics["epoch_loss"]) == pytest.approx(means[-1], rel=1e-6)
    assert float(trainer.callback_metrics["both_epoch"]) == pytest.approx(means[-1], rel=1e-6)


def test_forked_names_step_and_epoch(tmp_path: Path) -> None:
    """on_step and on_epoch: the logger gets both_step and both_epoch, never a bare both."""
    trainer, _, logger, plain, _ = run(tmp_path, 1, 10, 4, log_every_n_steps=1)
    header = rows(logger)[0].keys()
    assert {"both_step", "both_epoch"} <= set(header)
    assert "both" not in header
    assert "both" not in trainer.logged_metrics
    assert trainer.logged_metrics["both_step"] == plain[-1][-1][0]
    assert float(trainer.callback_metrics["both_step"]) == plain[-1][-1][0]
    assert float(trainer.callback_metrics["both"]) == plain[-1][-1][0]  # the last step's
    assert trainer.logged_metrics["both_epoch"] == pytest.approx(weighted(plain[-1]), rel=1e-6)


def test_validation_means_are_weighted_by_batch_size(tmp_path: Path) -> None:
    """val_loss over batches of 4, 4, 2, with the trained weights (validation follows the
    epoch's last step): the mean weighted by batch size, computed by hand."""
    trainer, model, logger, _, val = run(tmp_path, 1, 8, 4)
    with torch.no_grad():
        pairs = [(float(model.loss(b)), len(b[0])) for b in val]
    assert [n for _, n in pairs] == [4, 4, 2]
    assert abs(weighted(pairs) - sum(v for v, _ in pairs) / 3) > 1e-3
    assert float(trainer.callback_metrics["val_loss"]) == pytest.approx(weighted(pairs), rel=1e-6)
    assert trainer.logged_metrics["val_loss"] == pytest.approx(weighted(pairs), rel=1e-6)
    (row,) = [r for r in rows(logger) if r["val_loss"]]
    assert int(row["step"]) == trainer.global_step - 1
    assert float(row["val_loss"]) == pytest.approx(weighted(pairs), rel=1e-6)
    assert float(row["epoch"]) == 0.0  # the epoch it validated, as its training rows say
    assert {float(r["epoch"]) for r in rows(logger)} == {0.0}


def test_callback_and_logged_metrics_after_fit(tmp_path: Path) -> None:
    """After fit: the last step's value, the epoch means and the validation mean, in both
    dicts (callback_metrics as 0-dim CPU tensors, logged_metrics as floats)."""
    trainer, model, _, plain, val = run(tmp_path, 2, 10, 4, log_every_n_steps=1)
    last = plain[-1][-1][0]
    mean = weighted(plain[-1])
    with torch.no_grad():
        val_mean = weighted([(float(model.loss(b)), len(b[0])) for b in val])
    want = {
        "train_loss": last,
        "both_step": last,
        "epoch_loss": mean,
        "both_epoch": mean,
        "val_loss": val_mean,
    }
    metrics = trainer.callback_metrics
    assert set(want) <= set(metrics), sorted(metrics)
    for name, value in want.items():
        tensor = metrics[name]
        assert isinstance(tensor, torch.Tensor) and tensor.dim() == 0, name
        assert tensor.device.type == "cpu", name
        assert float(tensor) == pytest.approx(value, rel=1e-6), name
    logged = trainer.logged_metrics
    assert set(want) <= set(logged), sorted(logged)
    for name, value in want.items():
        assert isinstance(logged[name], float), name
        assert logged[name] == pytest.approx(value, rel=1e-6), name
    assert logged["epoch"] == 1.0  # the last epoch trained (0-based), as Lightning 1.0 logs


class EpochHookLogging(Logging):
    """Logs from training_epoch_end (an epoch-end hook of Lightning 1.0's self.log) and from
    on_train_epoch_end (recorded only from Lightning 1.1; with ``in_hook``): 10 + the epoch
    each time."""

    def __init__(self, in_hook: bool) -> None:
        super().__init__()
        self.in_hook = in_hook

    def training_epoch_end(self, outputs: list[Any]) -> None:
        self.log("from_epoch_end", 10.0 + self.current_epoch)

    def on_train_epoch_end(self, outputs: Any) -> None:
        if self.in_hook:
            self.log("from_on_train_epoch_end", 10.0 + self.current_epoch)


def test_training_epoch_end_logs_that_epochs_value(tmp_path: Path) -> None:
    trainer = cardcage.Trainer(max_epochs=2, logger=CSVLogger(tmp_path), progress_bar=False)
    trainer.fit(EpochHookLogging(in_hook=False), DataLoader(data(8, 1), batch_size=4))
    assert float(trainer.callback_metrics["from_epoch_end"]) == 11.0
    assert trainer.logged_metrics["from_epoch_end"] == 11.0
    logger = trainer.logger
    assert isinstance(logger, CSVLogger)
    by_epoch = {
        float(r["epoch"]): float(r["from_epoch_end"]) for r in rows(logger) if r["from_epoch_end"]
    }
    assert by_epoch == {0.0: 10.0, 1.0: 11.0}


def test_a_value_logged_in_on_train_epoch_end_is_that_epochs(tmp_path: Path) -> None:
    """on_train_epoch_end logs 10 + epoch: each epoch's row holds its own value, and after
    2 epochs the metric holds epoch 1's (11), never the epoch before's."""
    logger = CSVLogger(tmp_path)
    trainer = cardcage.Trainer(max_epochs=2, logger=logger, progress_bar=False)
    trainer.fit(EpochHookLogging(in_hook=True), DataLoader(data(8, 1), batch_size=4))
    assert float(trainer.callback_metrics["from_on_train_epoch_end"]) == 11.0
    assert trainer.logged_metrics["from_on_train_epoch_end"] == 11.0
    by_epoch = {
        float(r["epoch"]): float(r["from_on_train_epoch_end"])
        for r in rows(logger)
        if r["from_on_train_epoch_end"]
    }
    assert by_epoch == {0.0: 10.0, 1.0: 11.0}


# -- refusals ------------------------------------------------------------------------------


class Refused(cardcage.Module):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.where = where

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.layer(x)
        if self.where == "vector":
            self.log("per_sample", (out - y).pow(2).squeeze(1))
        return torch.nn.functional.mse_loss(out, y)

    def on_fit_start(self) -> None:
        if self.where == "fit_start":
            self.log("too_early", 1.0)

    def training_epoch_end(self, outputs: list[Any]) -> None:
        if self.where == "epoch_end":
            self.log("epoch_thing", torch.tensor(1.0), on_step=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


@pytest.mark.parametrize(
    ("where", "name"),
    [("vector", "per_sample"), ("epoch_end", "epoch_thing"), ("fit_start", "too_early")],
)
def test_refusals_name_the_metric(where: str, name: str) -> None:
    """A value of several elements, on_step=True in an epoch-end hook, and a hook that owns
    no step or epoch (docs/training-loop.md, "Logging")."""
    trainer = cardcage.Trainer(progress_bar=False)
    with pytest.raises(cardcage.MisconfigurationError, match=name):
        trainer.fit(Refused(where), DataLoader(data(8, 1), batch_size=4))


class ValidationStepValues(cardcage.Module):
    """Logs a step value (on_step=True) from validation_step."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = (self.w - batch[0]).pow(2).mean()
        self.log("loss_now", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("vstep", float(10 * self.current_epoch + batch_idx), on_step=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_step_value_in_validation_step_is_refused_by_name(tmp_path: Path) -> None:
    """self.log(on_step=True) in validation_step: refused, naming the metric (written later
    it would have sat in a training row of the next epoch, and the last epoch's lost)."""
    trainer = cardcage.Trainer(max_epochs=2, logger=CSVLogger(tmp_path), progress_bar=False)
    loader = DataLoader(TensorDataset(torch.ones(3, 1)), batch_size=1)
    with pytest.raises(cardcage.MisconfigurationError, match="vstep"):
        trainer.fit(ValidationStepValues(), loader, loader)


class BarLogging(cardcage.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        self.log("seen", float(batch_idx + 1), prog_bar=True)
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_prog_bar_values_are_shown_in_the_bar(capsys: pytest.CaptureFixture[str]) -> None:
    """self.log(..., prog_bar=True): the value is in the bar's line (the last step's at the
    epoch's end) and in trainer.progress_bar_metrics."""
    trainer = cardcage.Trainer(max_epochs=1, progress_bar=True, logger=False)
    trainer.fit(BarLogging(), DataLoader(TensorDataset(torch.ones(6, 1)), batch_size=2))
    err = capsys.readouterr().err.replace("\r", "\n")
    assert "seen=3" in err, err
    assert trainer.progress_bar_metrics == {"seen": 3.0}


class EvalEndLogging(cardcage.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.layer(x).pow(2).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("v", float(batch_idx))

    def on_validation_epoch_end(self) -> None:
        # this run's mean is there already; what is logged here is this run's too
        self.log("twice_v", 2 * float(self.trainer.callback_metrics["v"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_on_validation_epoch_end_sees_and_logs_this_validation(tmp_path: Path) -> None:
    """Batches 0, 1, 2 of 2 samples log v = 0, 1, 2: v = 1; on_validation_epoch_end reads
    that and logs 2, written with the validation's other values."""
    trainer = cardcage.Trainer(max_epochs=1, logger=CSVLogger(tmp_path), progress_bar=False)
    data = DataLoader(TensorDataset(torch.ones(6, 1)), batch_size=2)
    trainer.fit(EvalEndLogging(), data, data)
    assert float(trainer.callback_metrics["twice_v"]) == 2.0
    assert trainer.logged_metrics["twice_v"] == 2.0 and trainer.logged_metrics["v"] == 1.0
