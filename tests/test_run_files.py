"""Run folders, checkpoint files and logger files under concurrency and hostile input.

- Two runs started at once into one folder each get their own ``version_<n>`` (claimed by
  ``mkdir``) and their own checkpoint names (claimed with ``O_EXCL``): two real processes
  that meet after picking, before writing.
- A checkpoint's ModelCheckpoint state never names, deletes or writes a file outside the
  run that loads it; filename templates that leave ``dirpath`` or cannot be formatted are
  refused when the callback is made.
- Temporary files of ``metrics.csv`` and ``hparams.yaml`` never open a planted link.
- Hyperparameters read back with PyYAML as they were given, or are refused by name.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage
from cardcage.callbacks import ModelCheckpoint
from cardcage.loggers import CSVLogger

BATCHES = 4


class Net(cardcage.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> DataLoader[Any]:
    x = torch.randn(BATCHES * 4, 4, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x[:, :1]), batch_size=4)


def files_below(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


# -- two runs at once -------------------------------------------------------------------------

#: One run, as a user's script: it waits for the other run at ``hook`` (after both picked a
#: version, or a checkpoint name), so that the two really overlap where they used to collide.
RUN = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    import cardcage
    from cardcage.callbacks import ModelCheckpoint

    root, me, hook, dirpath = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] or None
    meeting = Path(sys.argv[5])

    def meet():
        (meeting / f"{hook}-{me}").touch()
        deadline = time.monotonic() + 60
        while not all((meeting / f"{hook}-{who}").exists() for who in "ab"):
            assert time.monotonic() < deadline, "the other run never came"
            time.sleep(0.01)

    class Meet(cardcage.Callback):
        def on_train_start(self, trainer, pl_module):
            if hook == "start":
                meet()

        def on_save_checkpoint(self, trainer, pl_module):
            if hook == "save":
                meet()

    class Net(cardcage.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    x = torch.randn(16, 4)
    check = ModelCheckpoint(dirpath=dirpath)
    trainer = cardcage.Trainer(
        default_root_dir=root, max_epochs=1, log_every_n_steps=1, progress_bar=False,
        callbacks=[check, Meet()],
    )
    trainer.fit(Net(), DataLoader(TensorDataset(x, x[:, :1]), batch_size=4))
    print(json.dumps({"log_dir": trainer.logger.log_dir, "best": check.best_model_path}))
    """
)


def two_runs_at_once(tmp_path: Path, hook: str, dirpath: str = "") -> list[dict[str, str]]:
    script = tmp_path / "run.py"
    script.write_text(RUN)
    root = tmp_path / "runs"
    meeting = tmp_path / "meeting"
    meeting.mkdir()
    runs = [
        subprocess.Popen(
            [sys.executable, str(script), str(root), who, hook, dirpath, str(meeting)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for who in "ab"
    ]
    results = []
    for run in runs:
        out, err = run.communicate(timeout=240)
        assert run.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.slow
def test_two_runs_started_at_once_into_one_folder_take_their_own_versions(
    tmp_path: Path,
) -> None:
    """Both pick a version when fit starts and meet before their first write: each has a
    version folder of its own, with its own rows and its own checkpoint (before, both wrote
    version_0: one metrics.csv, one checkpoint claimed by both)."""
    a, b = two_runs_at_once(tmp_path, "start")
    logs = tmp_path / "runs" / "logs"
    assert sorted({a["log_dir"], b["log_dir"]}) == [
        str(logs / "version_0"),
        str(logs / "version_1"),
    ]
    for run in (a, b):
        rows = (Path(run["log_dir"]) / "metrics.csv").read_text().splitlines()
        assert rows[0].startswith("step,") and len(rows) == 1 + BATCHES  # one run's rows
        assert Path(run["best"]).parent == Path(run["log_dir"]) / "checkpoints"
        assert Path(run["best"]).is_file()
    assert not [name for name in files_below(logs) if name.endswith((".tmp", ".claim"))]


@pytest.mark.slow
def test_two_runs_saving_into_one_folder_at_once_claim_their_own_names(tmp_path: Path) -> None:
    """Both name their checkpoint before either writes it: the second takes ``-v0`` (before,
    both took ``epoch=0-step=4.ckpt`` and one replaced the other's file)."""
    shared = tmp_path / "shared"
    a, b = two_runs_at_once(tmp_path, "save", str(shared))
    assert sorted(Path(run["best"]).name for run in (a, b)) == [
        "epoch=0-step=4-v0.ckpt",
        "epoch=0-step=4.ckpt",
    ]
    assert files_below(shared) == ["epoch=0-step=4-v0.ckpt", "epoch=0-step=4.ckpt"]


# -- the callback state of a checkpoint ---------------------------------------------------------


def fit(root: Path, check: ModelCheckpoint, **flags: Any) -> cardcage.Trainer:
    torch.manual_seed(0)
    flags = {"max_epochs": 2, **flags}
    trainer = cardcage.Trainer(
        default_root_dir=root, progress_bar=False, callbacks=[check], **flags
    )
    trainer.fit(Net(), loader())
    return trainer


def test_a_checkpoint_naming_files_elsewhere_never_deletes_or_writes_there(
    tmp_path: Path,
) -> None:
    """A weights_only-safe file whose callback state names another folder and a best
    checkpoint there (worse than any new one): resuming it deletes nothing there and writes
    nothing there (before, the run wrote into that folder and deleted the victim)."""
    first = fit(tmp_path / "a", ModelCheckpoint(monitor="loss", save_last=True))
    path = Path(first.checkpoint_callback.last_model_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = elsewhere / "victim.ckpt"
    victim.write_bytes(b"precious")
    state = torch.load(path, weights_only=True)
    key = next(k for k in state["callbacks"] if k.startswith("ModelCheckpoint"))
    state["callbacks"][key].update(
        dirpath=str(elsewhere),
        best_model_path=str(victim),
        best_k_models={str(victim): 1e9, "../../victim.ckpt": 1e9},
        kth_best_model_path=str(victim),
    )
    hostile = tmp_path / "hostile.ckpt"
    torch.save(state, hostile)

    check = ModelCheckpoint(monitor="loss", save_last=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = fit(tmp_path / "b", check, resume_from_checkpoint=str(hostile), max_epochs=4)
    assert victim.read_bytes() == b"precious"
    assert files_below(elsewhere) == ["victim.ckpt"]  # nothing written there
    assert any("dropped from its bookkeeping" in str(w.message) for w in caught)
    own = Path(second.logger.log_dir) / "checkpoints"
    assert check.dirpath == str(own) and Path(check.best_model_path).parent == own
    assert all(Path(p).parent == own for p in check.best_k_models)


def regular_files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


@pytest.mark.parametrize("given", [False, True], ids=["default-dirpath", "dirpath-of-the-copy"])
def test_resuming_a_copied_run_folder_leaves_the_original_alone(
    tmp_path: Path, given: bool
) -> None:
    """A run folder copied, then resumed from the copy's last.ckpt: the original's files stay
    as they were, and every checkpoint the resumed run names is in its own folder (before,
    the resumed run took the original's folder from the state, deleted the original's best
    checkpoint and wrote its new ones beside it)."""
    original = tmp_path / "original"
    fit(original, ModelCheckpoint(monitor="loss", save_top_k=1, save_last=True))
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    before = regular_files(original)

    copied = copy / "logs" / "version_0" / "checkpoints"
    check = ModelCheckpoint(copied if given else None, monitor="loss", save_top_k=1, save_last=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = fit(copy, check, resume_from_checkpoint=str(copied / "last.ckpt"), max_epochs=4)
    # a new version folder holds none of the files the state names: the top k start afresh
    dropped = any("dropped from its bookkeeping" in str(w.message) for w in caught)
    assert dropped is not given
    assert regular_files(original) == before
    # given: the copy's folder, its top k continued; else the new run's own version folder
    own = copied if given else Path(second.logger.log_dir) / "checkpoints"
    assert check.dirpath == str(own)
    assert Path(check.best_model_path).parent == own
    assert all(Path(p).parent == own for p in check.best_k_models)


@pytest.mark.parametrize(
    ("filename", "why"),
    [
        ("../x", "outside dirpath"),
        ("sub/../../{epoch}", "outside dirpath"),
        ("/tmp/{epoch}", "outside dirpath"),
        ("{epoch:zz}", "format spec that an int does not take"),
        ("{val_loss:d}", "format spec that a float does not take"),
    ],
)
def test_templates_that_leave_dirpath_or_cannot_be_formatted_are_refused(
    filename: str, why: str
) -> None:
    """Refused when the callback is made (before: written outside dirpath, or a raw
    ValueError after the first epoch)."""
    with pytest.raises(cardcage.MisconfigurationError) as raised:
        ModelCheckpoint(filename=filename)
    assert f"ModelCheckpoint(filename={filename!r})" in str(raised.value)
    assert why in str(raised.value)


def test_a_template_with_a_subfolder_stays_inside_dirpath(tmp_path: Path) -> None:
    check = ModelCheckpoint(tmp_path / "c", filename="best/{epoch:03d}-{loss:.2f}")
    fit(tmp_path, check, max_epochs=1)
    assert Path(check.best_model_path).parent == tmp_path / "c" / "best"


def test_save_weights_only_is_refused_by_name_with_the_fix() -> None:
    with pytest.raises(cardcage.MisconfigurationError) as raised:
        ModelCheckpoint(save_weights_only=True)
    assert "ModelCheckpoint(save_weights_only=True) is not supported" in str(raised.value)
    assert "'state_dict'" in str(raised.value)


# -- temporary files --------------------------------------------------------------------------


def test_temporary_files_never_open_a_planted_link(tmp_path: Path) -> None:
    """Links planted where the writers' temporary files used to go (``<file>.<pid>.tmp``):
    their target is never written, and no temporary file is left."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    logger = CSVLogger(tmp_path, version=0)
    folder = Path(logger.log_dir)
    folder.mkdir(parents=True)
    for name in ("metrics.csv", "hparams.yaml"):
        (folder / f"{name}.{os.getpid()}.tmp").symlink_to(victim)
    logger.log_hyperparams({"lr": 0.1})
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.log_metrics({"loss": 1.0, "acc": 0.5}, step=1)  # a new column: the file again
    assert victim.read_text() == "precious"
    assert (folder / "metrics.csv").read_text() == "step,loss,acc\n0,1.0,\n1,1.0,0.5\n"
    left = [p.name for p in folder.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()]
    assert left == []


# -- hyperparameters ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    ["del\x7f", "c1\x85\x9f\x80", "lone \ud800 surrogate", "sep\u2028\u2029\ufeff", "\x00\t\n"],
)
def test_hparams_with_characters_yaml_escapes_read_back_equal(tmp_path: Path, value: str) -> None:
    yaml = pytest.importorskip("yaml")
    logger = CSVLogger(tmp_path)
    params = {"name": value, f"key {value}": [value, {"nested": value}]}
    logger.log_hyperparams(params)
    path = Path(logger.log_dir) / "hparams.yaml"
    assert yaml.safe_load(path.read_bytes().decode("utf-8")) == params


def test_hparams_with_colliding_keys_are_refused_naming_them(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path)
    with pytest.raises(cardcage.MisconfigurationError) as raised:
        logger.log_hyperparams({"opt": {1: "a", "1": "b"}})
    assert "the keys 1 and '1' in 'opt' are both written as '1'" in str(raised.value)


def test_recursive_hparams_are_refused_naming_the_key(tmp_path: Path) -> None:
    loop: dict[str, Any] = {"lr": 0.1}
    loop["again"] = loop
    logger = CSVLogger(tmp_path)
    with pytest.raises(cardcage.MisconfigurationError) as raised:
        logger.log_hyperparams({"opt": loop})
    assert "'opt.again' holds itself" in str(raised.value)
    assert not (Path(logger.log_dir) / "hparams.yaml").exists()
