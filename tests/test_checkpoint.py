"""Checkpoints: resuming equals training straight through, writes are atomic, loads are safe.

Every comparison is against a run that was not interrupted, from the same seed; the models
have dropout and the loaders shuffle, so a resume that restored the wrong random state (or
drew the wrong batches) shows up as different weights.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage
from cardcage.backend.launch import restarts
from cardcage.checkpoints import io as checkpoint
from cardcage.checkpoints import validation
from cardcage.config import owners

BATCHES_PER_EPOCH = 8


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(BATCHES_PER_EPOCH * 8, 4, generator=generator)
    return TensorDataset(x, (x[:, :1] - 2 * x[:, 1:2]).tanh())


def loader(shuffle: bool = True) -> DataLoader[Any]:
    return DataLoader(dataset(), batch_size=8, shuffle=shuffle)


class Net(torch.nn.Module):
    """An MLP with dropout and momentum SGD; ``on_step`` runs at the start of every step."""

    def __init__(self, dropout: float = 0.25, schedule: bool = False):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 32),
            torch.nn.Tanh(),
            torch.nn.Dropout(dropout),
            torch.nn.Linear(32, 1),
        )
        self.schedule = schedule
        self.on_step: Callable[[int], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.on_step is not None:
            self.on_step(batch_idx)
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        if not self.schedule:
            return optimizer
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)]


def fresh_model(**kwargs: Any) -> Net:
    torch.manual_seed(0)
    return Net(**kwargs)


def straight(epochs: int = 2, shuffle: bool = True, **kwargs: Any) -> dict[str, torch.Tensor]:
    model = fresh_model(**kwargs)
    cardcage.Trainer(max_epochs=epochs, progress_bar=False).fit(model, loader(shuffle))
    return model.state_dict()


def assert_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=1e-6, msg=key)


def resume(path: Path, epochs: int = 2, shuffle: bool = True, **kwargs: Any) -> cardcage.Trainer:
    # A fresh model object whose initial weights and random state differ from the saved run.
    torch.manual_seed(1234)
    model = Net(**kwargs)
    trainer = cardcage.Trainer(max_epochs=epochs, resume_from_checkpoint=path, progress_bar=False)
    trainer.fit(model, loader(shuffle))
    trainer.model_after = model  # type: ignore[attr-defined]
    return trainer


# -- resuming ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_resume_after_an_epoch_equals_training_straight(
    tmp_path: Path, shuffle: bool, dropout: float
) -> None:
    expected = straight(shuffle=shuffle, dropout=dropout)

    model = fresh_model(dropout=dropout)
    first = cardcage.Trainer(max_epochs=1, progress_bar=False)
    first.fit(model, loader(shuffle))
    path = tmp_path / "epoch1.ckpt"
    first.save_checkpoint(path)

    resumed = resume(path, shuffle=shuffle, dropout=dropout)
    assert resumed.current_epoch == 2
    assert resumed.global_step == 2 * BATCHES_PER_EPOCH
    assert len(resumed.losses) == BATCHES_PER_EPOCH  # only the second epoch ran
    assert_close(resumed.model_after.state_dict(), expected)  # type: ignore[attr-defined]


def test_resume_restores_the_scheduler_and_momentum(tmp_path: Path) -> None:
    expected = straight(epochs=3, schedule=True)
    model = fresh_model(schedule=True)
    first = cardcage.Trainer(max_epochs=1, progress_bar=False)
    first.fit(model, loader())
    first.save_checkpoint(tmp_path / "a.ckpt")

    resumed = resume(tmp_path / "a.ckpt", epochs=3, schedule=True)
    assert_close(resumed.model_after.state_dict(), expected)  # type: ignore[attr-defined]
    assert resumed.optimization.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 / 8)


@pytest.mark.parametrize("stop", [3, 11])
def test_resume_after_max_steps_stopped_mid_epoch(tmp_path: Path, stop: int) -> None:
    expected = straight()
    model = fresh_model()
    first = cardcage.Trainer(max_epochs=2, max_steps=stop, progress_bar=False)
    first.fit(model, loader())
    assert first.global_step == stop
    assert first.current_epoch == stop // BATCHES_PER_EPOCH  # the epoch is not over
    path = tmp_path / "mid.ckpt"
    first.save_checkpoint(path)

    resumed = resume(path)
    assert resumed.global_step == 2 * BATCHES_PER_EPOCH
    assert len(resumed.losses) == 2 * BATCHES_PER_EPOCH - stop
    assert_close(resumed.model_after.state_dict(), expected)  # type: ignore[attr-defined]


@pytest.mark.parametrize("at_step", [0, 3, 8, 13])
def test_checkpoint_saved_inside_training_step_resumes_exactly(
    tmp_path: Path, at_step: int
) -> None:
    """A checkpoint written from inside ``training_step`` (at the first batch of an epoch
    too) continues at that batch, with that batch's random state."""
    expected = straight()
    path = tmp_path / "inside.ckpt"
    model = fresh_model()
    trainer = cardcage.Trainer(max_epochs=2, progress_bar=False)

    def save(batch_idx: int) -> None:
        if trainer.global_step == at_step:
            assert batch_idx == at_step % BATCHES_PER_EPOCH
            trainer.save_checkpoint(path)

    model.on_step = save
    trainer.fit(model, loader())
    # Saving changed nothing in the run that saved.
    assert_close(model.state_dict(), expected)
    saved = checkpoint.load(path)
    assert saved["global_step"] == at_step

    resumed = resume(path)
    assert resumed.global_step == 2 * BATCHES_PER_EPOCH
    assert len(resumed.losses) == 2 * BATCHES_PER_EPOCH - at_step
    assert_close(resumed.model_after.state_dict(), expected)  # type: ignore[attr-defined]


def test_a_resumed_run_can_save_and_resume_again(tmp_path: Path) -> None:
    expected = straight(epochs=3)
    model = fresh_model()
    first = cardcage.Trainer(max_epochs=3, max_steps=5, progress_bar=False)
    first.fit(model, loader())
    first.save_checkpoint(tmp_path / "one.ckpt")

    torch.manual_seed(99)
    second_model = Net()
    second = cardcage.Trainer(
        max_epochs=3, max_steps=13, progress_bar=False, resume_from_checkpoint=tmp_path / "one.ckpt"
    )
    second.fit(second_model, loader())
    second.save_checkpoint(tmp_path / "two.ckpt")

    resumed = resume(tmp_path / "two.ckpt", epochs=3)
    assert_close(resumed.model_after.state_dict(), expected)  # type: ignore[attr-defined]


def test_checkpoint_contents(tmp_path: Path) -> None:
    model = fresh_model()
    trainer = cardcage.Trainer(max_epochs=1, progress_bar=False)
    trainer.fit(model, loader())
    trainer.save_checkpoint(tmp_path / "sub" / "c.ckpt")  # the folder is created
    state = checkpoint.load(tmp_path / "sub" / "c.ckpt")
    assert state["format"] == validation.FORMAT
    assert state["cardcage_version"] == cardcage.__version__
    assert (state["epoch"], state["global_step"], state["batch_idx"]) == (1, BATCHES_PER_EPOCH, 0)
    for key, value in model.state_dict().items():
        assert torch.equal(state["state_dict"][key], value)
    assert state["optimizers"][0]["state"]  # momentum buffers
    # Nothing but the checkpoint is left in the folder (no temporary file).
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["c.ckpt"]


def test_resume_with_another_number_of_optimizers_is_refused(tmp_path: Path) -> None:
    model = fresh_model()
    trainer = cardcage.Trainer(progress_bar=False)
    trainer.fit(model, loader())
    trainer.save_checkpoint(tmp_path / "c.ckpt")

    class TwoOptimizers(Net):
        def configure_optimizers(self) -> Any:
            return [
                torch.optim.SGD(self.net[0].parameters(), lr=0.1),
                torch.optim.SGD(self.net[3].parameters(), lr=0.1),
            ]

    other = cardcage.Trainer(max_epochs=2, resume_from_checkpoint=tmp_path / "c.ckpt")
    with pytest.raises(cardcage.MisconfigurationError, match="optimizer"):
        other.fit(TwoOptimizers(), loader())


# -- loading ----------------------------------------------------------------------------------

_unpickled: list[str] = []


def _record_unpickling(tag: str) -> str:
    _unpickled.append(tag)
    return tag


class Payload:
    """Pickles as a call to ``_record_unpickling``: loading it would run code."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_record_unpickling, ("ran",))


def test_load_uses_weights_only_and_refuses_pickled_objects(tmp_path: Path) -> None:
    model = fresh_model()
    trainer = cardcage.Trainer(progress_bar=False)
    trainer.fit(model, loader())
    state = trainer.checkpoint_state()
    state["extra"] = Payload()
    path = tmp_path / "evil.ckpt"
    torch.save(state, path)

    _unpickled.clear()
    # A MisconfigurationError that names the global and never suggests weights_only=False.
    refused = r"refused by torch\.load\(weights_only=True\).*_record_unpickling"
    with pytest.raises(cardcage.MisconfigurationError, match=refused) as raised:
        checkpoint.load(path)
    assert "weights_only=False" not in str(raised.value)
    assert _unpickled == []
    resumed = cardcage.Trainer(max_epochs=2, resume_from_checkpoint=path, progress_bar=False)
    with pytest.raises(cardcage.MisconfigurationError, match=refused):
        resumed.fit(fresh_model(), loader())
    assert _unpickled == []
    # The payload does run code when loaded without weights_only: the refusal above mattered.
    torch.load(path, weights_only=False)
    assert _unpickled == ["ran"]


def test_load_refuses_missing_and_foreign_files(tmp_path: Path) -> None:
    with pytest.raises(cardcage.MisconfigurationError, match="does not exist"):
        checkpoint.load(tmp_path / "nope.ckpt")
    torch.save({"state_dict": {}}, tmp_path / "foreign.pt")
    with pytest.raises(cardcage.MisconfigurationError, match="not a cardcage checkpoint"):
        checkpoint.load(tmp_path / "foreign.pt")
    # The Trainer checks the path when it is constructed, before anything runs.
    with pytest.raises(cardcage.MisconfigurationError, match=r"nope\.ckpt"):
        cardcage.Trainer(resume_from_checkpoint=tmp_path / "nope.ckpt")


def test_a_folder_is_refused_as_a_sharded_checkpoint_the_default_backend_cannot_read(
    tmp_path: Path,
) -> None:
    (tmp_path / "shards").mkdir()
    with pytest.raises(cardcage.MisconfigurationError, match=r"shards.*is a folder.*backend"):
        checkpoint.load(tmp_path / "shards")


def test_a_backend_may_write_and_read_a_format_of_its_own(tmp_path: Path) -> None:
    """Trainer.save_checkpoint and resume go through the backend's save_checkpoint and
    load_checkpoint (here: a folder with the model apart from the loop's state)."""
    from cardcage.backend.strategy.strategy import Strategy

    class Folder(Strategy):
        def save_checkpoint(self, trainer: Any, path: Any) -> None:
            Path(path).mkdir()
            torch.save(self.gather_state(trainer), Path(path) / "model.pt")
            checkpoint.save_atomic(trainer.loop_state(), Path(path) / "loop.pt")

        def load_checkpoint(self, trainer: Any, path: Any) -> dict[str, Any]:
            model = torch.load(Path(path) / "model.pt", weights_only=True)
            return {**checkpoint.load(Path(path) / "loop.pt"), **model}

    def fit(model: Net, **flags: Any) -> cardcage.Trainer:
        trainer = cardcage.Trainer(max_epochs=2, progress_bar=False, **flags)
        folder = Folder(trainer.selection)
        trainer.accelerator.save_checkpoint = folder.save_checkpoint  # type: ignore[method-assign]
        trainer.accelerator.load_checkpoint = folder.load_checkpoint  # type: ignore[method-assign]
        trainer.fit(model, loader())
        return trainer

    torch.manual_seed(0)
    straight = Net()
    fit(straight)
    torch.manual_seed(0)
    first = fit(Net(), max_steps=5)
    first.save_checkpoint(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["loop.pt", "model.pt"]
    resumed = Net()
    fit(resumed, resume_from_checkpoint=tmp_path / "ckpt")
    for a, b in zip(resumed.parameters(), straight.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# -- a crash while writing --------------------------------------------------------------------

#: Script text: ``stall_after(limit)`` makes ``save_atomic``'s writes stop once, inside
#: ``torch.save``, when ``limit`` bytes have reached the temporary file; the script prints
#: "writing" and sleeps there until the test signals it.
STALL_WRITES = textwrap.dedent(
    """
    import io, os, sys, time
    import torch
    from cardcage.checkpoints import io as checkpoint

    real_fdopen = os.fdopen


    def stall_after(limit):
        class Stalling(io.BufferedWriter):
            written, stalled = 0, False

            def write(self, data):
                n = super().write(data)
                Stalling.written += n
                if Stalling.written > limit and not Stalling.stalled:
                    Stalling.stalled = True  # once: torch writes on after an exception
                    self.flush()
                    print("writing", flush=True)
                    time.sleep(600)  # stopped here by the parent's signal
                return n

        def fdopen(fd, mode="r", *args, **kwargs):
            if mode == "wb":
                return Stalling(io.FileIO(fd, "wb"))
            return real_fdopen(fd, mode, *args, **kwargs)

        os.fdopen = fdopen
    """
)

WRITER = STALL_WRITES + textwrap.dedent(
    """
    payload_path, path = sys.argv[1:]
    payload = torch.load(payload_path, weights_only=True)
    checkpoint.save_atomic(payload, path)  # checkpoint 1, complete
    print("saved", payload["global_step"], flush=True)

    # Checkpoint 2 is large, and its writer stops (for the parent to kill it) once half of
    # it has reached the temporary file.
    payload["global_step"] = 999
    payload["state_dict"]["ballast"] = torch.randn(4_000_000)
    stall_after(8_000_000)
    checkpoint.save_atomic(payload, path)
    print("finished", flush=True)
    """
)


def test_killed_while_writing_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    """A writer process killed (SIGKILL) halfway through a large checkpoint leaves the
    previous checkpoint in place, loadable, and a new run resumes from it."""
    model = fresh_model()
    first = cardcage.Trainer(max_epochs=1, progress_bar=False)
    first.fit(model, loader())
    torch.save(first.checkpoint_state(), tmp_path / "payload.pt")
    (tmp_path / "run").mkdir()
    path = tmp_path / "run" / "last.ckpt"

    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path / "payload.pt"), str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stderr is not None
        first_line = child.stdout.readline()
        assert first_line.split() == ["saved", str(BATCHES_PER_EPOCH)], child.stderr.read()
        assert child.stdout.readline().strip() == "writing"
        partial = [p for p in path.parent.iterdir() if p != path]
        assert len(partial) == 1 and partial[0].suffix == ".tmp"
        assert partial[0].stat().st_size > 8_000_000
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL

    # The half-written file is not a checkpoint; the target is still checkpoint 1.
    with pytest.raises(Exception):  # noqa: B017 - torch's error for a truncated zip
        torch.load(partial[0], weights_only=True)
    state = checkpoint.load(path)
    assert state["global_step"] == BATCHES_PER_EPOCH
    assert "ballast" not in state["state_dict"]

    # And a new run resumes from it: equal to two epochs straight.
    resumed = resume(path)
    assert resumed.global_step == 2 * BATCHES_PER_EPOCH
    assert_close(resumed.model_after.state_dict(), straight())  # type: ignore[attr-defined]


# -- partial files ----------------------------------------------------------------------------

STALLED_WRITER = STALL_WRITES + textwrap.dedent(
    """
    stall_after(0)  # at its first write
    checkpoint.save_atomic({"state_dict": {"w": torch.randn(100_000)}}, sys.argv[1])
    print("finished", flush=True)
    """
)


def stalled_writer(path: Path) -> subprocess.Popen[str]:
    """A process stopped inside ``save_atomic``'s write of ``path``, its partial file there."""
    child = subprocess.Popen(
        [sys.executable, "-c", STALLED_WRITER, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stderr is not None
    if child.stdout.readline().strip() != "writing":
        child.kill()
        raise AssertionError(child.stderr.read())
    return child


def partial_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.suffix == ".tmp")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_write_stopped_by_a_signal_removes_its_partial_file(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """A writer stopped inside the write by SIGTERM, SIGINT or SIGHUP (how a launcher stops
    its ranks, Ctrl+C, a closed terminal) removes its partial file on the way out, and still
    ends as that signal ends it."""
    child = stalled_writer(tmp_path / "last.ckpt")
    try:
        assert len(partial_files(tmp_path)) == 1
        os.kill(child.pid, sig)
        child.wait(timeout=60)
    finally:
        child.kill()
        child.wait(timeout=60)
    assert child.returncode == -sig, child.stderr.read() if child.stderr else ""
    assert list(tmp_path.iterdir()) == []  # neither a partial file nor a checkpoint


def test_partial_files_of_killed_writers_are_cleared_when_fit_starts(tmp_path: Path) -> None:
    """A writer killed outright (SIGKILL) cannot clean up: the next fit with that
    ``default_root_dir`` removes its partial file, and leaves alone the one that a live
    process (another job sharing the folder) is writing right now."""
    killed = stalled_writer(tmp_path / "last.ckpt")
    killed.kill()
    killed.wait(timeout=60)
    [left] = partial_files(tmp_path)
    live = stalled_writer(tmp_path / "last.ckpt")
    try:
        writing = [name for name in partial_files(tmp_path) if name != left]
        assert len(writing) == 1 and f".{owners.owner(live.pid)}." in writing[0]
        cardcage.Trainer(default_root_dir=tmp_path, max_steps=1, progress_bar=False).fit(
            fresh_model(), loader()
        )
        assert partial_files(tmp_path) == writing
    finally:
        live.kill()
        live.wait(timeout=60)


def test_a_partial_file_is_a_dead_writers_when_its_pid_now_names_another_process(
    tmp_path: Path,
) -> None:
    """A partial file names its writer by pid and start time, as launchers' folders do: one
    whose pid now belongs to a process that started at another time (this one) was left by a
    writer that is gone, and is cleared; this process's own file, and one of another host,
    are kept."""
    pid, host = os.getpid(), owners.this_host()
    reused = tmp_path / f".last.ckpt.{pid}.1@{host}.abc_123.tmp"
    own = tmp_path / f".last.ckpt.{owners.owner()}.def456.tmp"
    other_host = tmp_path / f".last.ckpt.{pid}.1@another-host.ghi789.tmp"
    for path in (reused, own, other_host):
        path.write_bytes(b"part of a checkpoint")
    assert checkpoint.clear_partial_files(tmp_path) == [reused]
    assert sorted(tmp_path.iterdir()) == sorted([own, other_host])


# -- the run a checkpoint records -------------------------------------------------------------


def torchrun_attempt(monkeypatch: pytest.MonkeyPatch, job: str, attempt: int) -> None:
    """This process as attempt ``attempt`` of a one-process torchrun job ``job``."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE"):
        monkeypatch.setenv(name, "1" if "WORLD" in name else "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", job)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))


def first_steps(root: Path, **flags: Any) -> list[int]:
    """Fit to global step 6 with ``default_root_dir=root``; the global steps it trained
    (a resume from step 4 trains [4, 5])."""
    trainer = cardcage.Trainer(
        default_root_dir=root, max_steps=6, max_epochs=2, progress_bar=False, **flags
    )
    model = fresh_model()
    steps: list[int] = []
    model.on_step = lambda batch_idx: steps.append(trainer.global_step)
    trainer.fit(model, loader())
    return steps


def test_a_cluster_restart_resumes_only_from_its_own_jobs_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A restarted torchrun attempt resumes from ``last.ckpt`` only when its own job wrote
    it; one of another job, or one that records no run (an older cardcage's), is not loaded,
    and fit says once whose it is. ``resume_from_checkpoint`` still loads any of them."""
    last = tmp_path / "last.ckpt"
    torchrun_attempt(monkeypatch, "job-1", 0)
    first_steps(tmp_path, checkpoint_every_n_steps=4)  # job-1 leaves last.ckpt at step 4
    recorded = checkpoint.load(last)["run"]
    assert recorded["job"].startswith("torchrun job job-1 (agent ") and recorded["fit"]

    torchrun_attempt(monkeypatch, "job-1", 1)
    assert first_steps(tmp_path) == [4, 5]  # its own job's: resumed

    torchrun_attempt(monkeypatch, "job-2", 1)
    caplog.clear()
    assert first_steps(tmp_path) == list(range(6))  # another job's: started afresh
    warnings = [r.getMessage() for r in caplog.records if "another run" in r.getMessage()]
    assert len(warnings) == 1
    assert f"{last} was written by another run (torchrun job job-1 (agent " in warnings[0]
    assert f"resume_from_checkpoint={str(last)!r}" in warnings[0]

    state = checkpoint.load(last)
    del state["run"]  # as an earlier cardcage wrote it
    checkpoint.save_atomic(state, last)
    torchrun_attempt(monkeypatch, "job-1", 1)
    caplog.clear()
    assert first_steps(tmp_path) == list(range(6))
    assert "it records no run" in caplog.text

    assert first_steps(tmp_path, resume_from_checkpoint=last) == [4, 5]


@pytest.mark.parametrize(
    ("env", "job"),
    [
        ({}, None),
        ({"SLURM_JOB_ID": "77"}, "SLURM job 77"),
        (
            {"SLURM_JOB_ID": "78", "SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "3"},
            "SLURM job 78 (array 70_3)",
        ),
        ({"TORCHELASTIC_RUN_ID": "r1", "GROUP_WORLD_SIZE": "2"}, "torchrun job r1"),
        (
            {"TORCHELASTIC_RUN_ID": "none", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "n0"}
            | {"MASTER_PORT": "29500"},
            "torchrun job none at n0:29500 (no --rdzv-id)",
        ),
    ],
)
def test_the_job_a_checkpoint_records(env: dict[str, str], job: str | None) -> None:
    """A SLURM job is its id (with the array task); a torchrun job of several nodes its
    ``--rdzv-id`` (``none`` without one: then its master's address); one node adds the
    agent that restarts its workers (two jobs given the same ``--rdzv-id`` differ)."""
    assert restarts.cluster_job(env) == job
    one_node = restarts.cluster_job({"TORCHELASTIC_RUN_ID": "r1", "GROUP_WORLD_SIZE": "1"})
    assert one_node == f"torchrun job r1 (agent {os.getppid()} on {socket.gethostname()})"
