"""Checkpoint flags checked early, and checkpoint writes that fail saying why.

- ``default_root_dir`` is checked when the Trainer is made: a folder that is, or can be
  made, writable (a file, a read-only mount, a place under /proc or /sys is refused).
- ``resume_from_checkpoint`` is opened once by ``fit`` in the calling process, before any
  process or port exists: empty, truncated, foreign, refused by ``weights_only`` or not
  fitting the model is a MisconfigurationError saying which; under ddp and ddp_spawn no
  process is started.
- A checkpoint write that fails (no space, read-only) raises ``cardcage.CheckpointError``
  naming the path and the cause; the previous checkpoint stays whole, no partial file stays.

Full disks and read-only folders are real: a tiny tmpfs mounted for the test (as root),
skipped with the reason where mounting is not allowed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from processes import watching_children
from torch.utils.data import DataLoader, TensorDataset

import cardcage
from cardcage import sdk
from cardcage.checkpoints import io as checkpoint
from cardcage.checkpoints import validation
from cardcage.loggers import CSVLogger, TensorBoardLogger
from cardcage.testing import harness as kit_harness
from cardcage.train import requeue

#: A bad input must fail this fast: before the ranks start, which takes 4 s and more.
FAST_S = 3.0


class Net(torch.nn.Module):
    """A small MLP; ``hidden`` changes its shapes, ``extra`` adds a layer, ``ballast`` adds
    a buffer of that many floats (a large checkpoint)."""

    def __init__(self, hidden: int = 8, extra: bool = False, ballast: int = 0):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
        )
        if extra:
            self.extra = torch.nn.Linear(2, 2)
        if ballast:
            self.register_buffer("ballast", torch.zeros(ballast))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def loader() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(32, 4, generator=generator)
    return DataLoader(TensorDataset(x, x[:, :1] * x[:, 1:2]), batch_size=4)


def trained(path: Path, model: Net | None = None, **flags: Any) -> cardcage.Trainer:
    """One epoch of ``model`` (a fresh Net) on the CPU, saved to ``path``."""
    torch.manual_seed(0)
    trainer = cardcage.Trainer(progress_bar=False, **flags)
    trainer.fit(model or Net(), loader())
    trainer.save_checkpoint(path)
    return trainer


@contextlib.contextmanager
def tiny_tmpfs(folder: Path, options: str = "size=64k") -> Iterator[Path]:
    """A tmpfs of its own at ``folder`` (64 KiB by default): a disk that fills up."""
    folder.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command: a tiny tmpfs is how this test fills a disk")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs ({mounted.stderr.strip() or mounted.returncode}): mounting "
            "needs root (or CAP_SYS_ADMIN), and this test fills a real disk"
        )
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def files_below(folder: Path) -> list[str]:
    """Everything under ``folder``, hidden files included, as sorted relative paths."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


def fill(folder: Path) -> None:
    """Write a ballast file in ``folder`` until its disk is full."""
    with contextlib.suppress(OSError), open(folder / "ballast", "wb") as stream:
        while True:
            stream.write(b"\0" * 4096)
            stream.flush()


# -- default_root_dir -------------------------------------------------------------------------


def test_default_root_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "runs").write_text("a file")
    with pytest.raises(cardcage.MisconfigurationError) as raised:
        cardcage.Trainer(default_root_dir=tmp_path / "runs")
    message = str(raised.value)
    assert f"default_root_dir={str(tmp_path / 'runs')!r}" in message
    assert "is a file, not a folder" in message and "Give a folder" in message


def test_default_root_dir_below_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "runs").write_text("a file")
    with pytest.raises(cardcage.MisconfigurationError, match="is a file, so no folder"):
        cardcage.Trainer(default_root_dir=tmp_path / "runs" / "today")


@pytest.mark.parametrize("place", ["/proc/cardcage-runs", "/sys/cardcage/runs"])
def test_default_root_dir_where_no_file_can_be_made_is_refused(place: str) -> None:
    """/proc and /sys: even root cannot write there, though permission bits say it may."""
    top = "/" + place.split("/")[1]
    if not os.path.isdir(top):
        pytest.skip(f"no {top} on this system")
    with pytest.raises(cardcage.MisconfigurationError) as raised:
        cardcage.Trainer(default_root_dir=place)
    message = str(raised.value)
    assert f"default_root_dir={place!r} is not writable" in message
    assert "errno" in message and "Give a folder you can write to" in message
    assert not os.path.exists(place)


def test_default_root_dir_on_a_read_only_disk_is_refused(tmp_path: Path) -> None:
    with tiny_tmpfs(tmp_path / "ro", "size=64k,ro") as folder:
        for target in (folder, folder / "runs"):
            with pytest.raises(cardcage.MisconfigurationError) as raised:
                cardcage.Trainer(default_root_dir=target)
            assert f"default_root_dir={str(target)!r} is not writable" in str(raised.value)
            assert f"read-only file system (errno {errno.EROFS})" in str(raised.value)


@pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0,
    reason="root writes into a folder whatever its permission bits; the read-only mount and "
    "/proc tests cover root",
)
def test_default_root_dir_without_write_permission_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with pytest.raises(cardcage.MisconfigurationError, match="permission denied"):
            cardcage.Trainer(default_root_dir=folder)
    finally:
        folder.chmod(stat.S_IRWXU)


def test_a_missing_default_root_dir_is_accepted_and_not_made_by_the_check(
    tmp_path: Path,
) -> None:
    target = tmp_path / "runs" / "today"
    trainer = cardcage.Trainer(default_root_dir=target, checkpoint_every_n_steps=4)
    assert list(tmp_path.iterdir()) == []  # the check created nothing, not even a probe file
    trainer.fit(Net(), loader())
    assert (target / "last.ckpt").is_file()  # the first write made it


# -- resume_from_checkpoint: what is wrong with the file ---------------------------------------

_ran: list[str] = []


def _record(tag: str) -> str:
    _ran.append(tag)
    return tag


class Payload:
    """Unpickles as a call to ``_record``: loading it would run code."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_record, ("ran",))


def _write(path: Path, data: bytes) -> None:
    path.write_bytes(data)


BadFile = Callable[[Path, dict[str, Any]], Any]

BAD_FILES: dict[str, tuple[BadFile, str]] = {
    "empty": (lambda p, good: _write(p, b""), "is empty (0 bytes)"),
    "truncated": (
        lambda p, good: (torch.save(good, p), _write(p, p.read_bytes()[: p.stat().st_size // 2])),
        "is truncated or not a torch file",
    ),
    "only its start": (
        lambda p, good: (torch.save(good, p), _write(p, p.read_bytes()[:100])),
        "is truncated or not a torch file",
    ),
    "garbage": (lambda p, good: _write(p, bytes(range(256)) * 4), "is truncated or not a torch"),
    "text": (lambda p, good: _write(p, b"hello\n"), "is truncated or not a torch file"),
    "a list": (lambda p, good: torch.save([1, 2], p), "is not a cardcage checkpoint: it holds a"),
    "a bare state_dict": (
        lambda p, good: torch.save(good["state_dict"], p),
        "it holds only tensors ('net.0.weight'",
    ),
    "a foreign dict": (
        lambda p, good: torch.save({"weights": good["state_dict"], "step": 3}, p),
        "is not a cardcage checkpoint: it has no 'state_dict'",
    ),
    "no state_dict": (
        lambda p, good: torch.save({k: v for k, v in good.items() if k != "state_dict"}, p),
        "is not a cardcage checkpoint: it has no 'state_dict'",
    ),
    "another format": (
        lambda p, good: torch.save({**good, "format": "lightning/1"}, p),
        "its format is 'lightning/1'",
    ),
    "a pickled object": (
        lambda p, good: torch.save({**good, "extra": Payload()}, p),
        "refused by torch.load(weights_only=True): it holds an object of",
    ),
    "a pickled module": (
        lambda p, good: torch.save({**good, "model": torch.nn.Linear(2, 2)}, p),
        "it holds an object of torch.nn.modules.linear.Linear",
    ),
}


@pytest.fixture(scope="module")
def good_state(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("good") / "good.ckpt"
    trained(path)
    return checkpoint.load(path)


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_checkpoint_file_is_named_with_what_is_wrong(
    case: str, good_state: dict[str, Any], tmp_path: Path
) -> None:
    make, says = BAD_FILES[case]
    path = tmp_path / "bad.ckpt"
    make(path, good_state)
    _ran.clear()
    trainer = cardcage.Trainer(progress_bar=False, resume_from_checkpoint=path)
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(cardcage.MisconfigurationError) as raised:
        trainer.fit(model, loader())
    message = str(raised.value)
    assert f"resume_from_checkpoint={str(path)!r}" in message
    assert says in message
    assert "weights_only=False" not in message  # never the unsafe way out
    assert "trainer.save_checkpoint" in message or "model" in message  # and a fix
    assert _ran == []  # nothing in the file ran
    assert trainer.global_step == 0
    for key, value in model.state_dict().items():  # and the model was not touched
        assert torch.equal(value, before[key])


def test_a_refused_checkpoint_names_what_torch_refused(tmp_path: Path) -> None:
    path = tmp_path / "evil.ckpt"
    torch.save({"format": validation.FORMAT, "extra": Payload()}, path)
    with pytest.raises(cardcage.MisconfigurationError) as raised:
        checkpoint.load(path)
    message = str(raised.value)
    assert "_record" in message  # the global torch refused
    assert "cardcage never loads one" in message
    assert "weights_only=False" not in message


@pytest.mark.parametrize(
    ("saved", "resumed", "says"),
    [
        (
            {"hidden": 8},
            {"hidden": 16},
            "shapes that differ: 'net.0.weight' is [8, 4] there, [16, 4] in the model",
        ),
        ({}, {"extra": True}, "keys of the model it lacks: 'extra.weight', 'extra.bias'"),
        ({"extra": True}, {}, "keys it holds that the model lacks: 'extra.weight'"),
    ],
)
def test_a_checkpoint_that_does_not_fit_the_model_is_refused_before_training(
    tmp_path: Path, saved: dict[str, Any], resumed: dict[str, Any], says: str
) -> None:
    path = tmp_path / "c.ckpt"
    trained(path, Net(**saved))
    trainer = cardcage.Trainer(progress_bar=False, resume_from_checkpoint=path)
    with pytest.raises(cardcage.MisconfigurationError) as raised:
        trainer.fit(Net(**resumed), loader())
    message = str(raised.value)
    assert f"resume_from_checkpoint={str(path)!r} does not fit the model (Net)" in message
    assert says in message
    assert "Resume with the model that wrote it" in message


def test_many_offending_keys_are_cut_to_the_first_few(tmp_path: Path) -> None:
    class Wide(Net):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(1, 1) for _ in range(6))

    path = tmp_path / "c.ckpt"
    trained(path)
    with pytest.raises(cardcage.MisconfigurationError, match=r"and 7 more\. Resume"):
        cardcage.Trainer(resume_from_checkpoint=path).fit(Wide(), loader())


def test_a_folder_for_a_backend_that_reads_files_only(tmp_path: Path) -> None:
    (tmp_path / "shards").mkdir()
    trainer = cardcage.Trainer(progress_bar=False, resume_from_checkpoint=tmp_path / "shards")
    with pytest.raises(cardcage.MisconfigurationError, match="reads only files"):
        trainer.fit(Net(), loader())


# -- a folder checkpoint (torch.distributed.checkpoint, as fsdp writes it) ---------------------


def sharded_folder(folder: Path, model: Net, loop: dict[str, Any] | None) -> Path:
    """A torch.distributed.checkpoint folder as fsdp's ``save_checkpoint`` lays it out: the
    model's shards and ``.metadata``, and ``loop.pt`` (when ``loop`` is given)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model.state_dict(), "optimizers": {}}, checkpoint_id=folder)
    if loop is not None:
        checkpoint.save_atomic(loop, folder / validation.LOOP_FILE)
    return folder


@pytest.fixture
def loop_state(good_state: dict[str, Any]) -> dict[str, Any]:
    state = {k: v for k, v in good_state.items() if k != "state_dict"}
    return {**state, "optimizers": [None], "sharded": True}


def fsdp_trainer(path: Path) -> cardcage.Trainer:
    pytest.importorskip("cardcage_fsdp")
    return cardcage.Trainer(
        distributed_backend="fsdp_spawn",
        num_processes=2,
        progress_bar=False,
        resume_from_checkpoint=path,
    )


def test_a_sharded_folder_that_fits_passes_the_check(
    tmp_path: Path, loop_state: dict[str, Any]
) -> None:
    folder = sharded_folder(tmp_path / "sharded.ckpt", Net(), loop_state)
    checked = validation.check_resume(folder, Net(), reads_folders=True, backend="fsdp")
    assert checked.path == str(folder) and checked.payload is None


@pytest.mark.parametrize(
    "case",
    ["empty folder", "no loop.pt", "truncated loop.pt", "broken .metadata", "other shapes"],
)
def test_a_bad_sharded_folder_is_refused_before_any_process_starts(
    tmp_path: Path, loop_state: dict[str, Any], case: str
) -> None:
    folder = tmp_path / "sharded.ckpt"
    if case == "empty folder":
        folder.mkdir()
        says = "is an empty folder"
    elif case == "no loop.pt":
        sharded_folder(folder, Net(), None)
        says = "torch.distributed.checkpoint folder without loop.pt"
    elif case == "truncated loop.pt":
        sharded_folder(folder, Net(), loop_state)
        loop = folder / validation.LOOP_FILE
        loop.write_bytes(loop.read_bytes()[:200])
        says = "(its loop.pt) is truncated or not a torch file"
    elif case == "broken .metadata":
        sharded_folder(folder, Net(), loop_state)
        (folder / validation.DCP_METADATA).write_bytes(b"\x80\x04not a pickle")
        says = "its .metadata is truncated"
    else:
        sharded_folder(folder, Net(hidden=16), loop_state)
        says = "shapes that differ: 'net.0.weight' is [16, 4] there, [8, 4] in the model"
    trainer = fsdp_trainer(folder)
    with watching_children() as started:
        begin = time.monotonic()
        with pytest.raises(cardcage.MisconfigurationError) as raised:
            trainer.fit(Net(), loader())
        elapsed = time.monotonic() - begin
    assert f"resume_from_checkpoint={str(folder)!r}" in str(raised.value)
    assert says in str(raised.value)
    assert started == set() and elapsed < FAST_S


# -- read once, and the other ways a run resumes -----------------------------------------------


def test_the_checkpoint_is_read_once_in_a_process_that_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c.ckpt"
    first = trained(path, max_steps=3)
    reads: list[str] = []
    real_load = torch.load

    def counting_load(f: Any, *args: Any, **kwargs: Any) -> Any:  # the real load, counted
        reads.append(os.fspath(f) if isinstance(f, (str, os.PathLike)) else repr(f))
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counting_load)
    trainer = cardcage.Trainer(max_epochs=2, progress_bar=False, resume_from_checkpoint=path)
    trainer.fit(Net(), loader())
    assert reads == [str(path)]
    assert first.global_step == 3 and trainer.global_step == 2 * len(loader())
    assert trainer._checked is None  # what was read is not kept after the resume


def test_a_file_that_changed_after_the_check_is_read_again(tmp_path: Path) -> None:
    """What prepare reuses is the file the check read, unchanged since (same inode, size
    and modification time); a changed file is read afresh."""
    path = tmp_path / "c.ckpt"
    trained(path, max_steps=3)
    checked = validation.check_resume(path, Net(), reads_folders=False, backend="cpu")
    trained(tmp_path / "other.ckpt", max_steps=5)
    os.replace(tmp_path / "other.ckpt", path)
    with checkpoint.reusing(checked):
        assert checkpoint.load(path)["global_step"] == 5


def test_automatic_resume_from_default_root_dir_still_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted process (``TORCHELASTIC_RESTART_COUNT`` > 0) resumes from
    ``default_root_dir/last.ckpt`` that its own torchrun job wrote, and a checked
    ``resume_from_checkpoint`` does not replace it."""
    root = tmp_path / "root"
    # One torchrun job of one process: its attempt 0 writes last.ckpt, its attempt 1 resumes.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE"):
        monkeypatch.setenv(name, "1" if "WORLD" in name else "0")
    torch.manual_seed(0)
    cardcage.Trainer(
        default_root_dir=root, checkpoint_every_n_steps=4, max_steps=5, progress_bar=False
    ).fit(Net(), loader())  # last.ckpt at step 4 (none at the last step: fit returns there)
    assert checkpoint.load(root / "last.ckpt")["global_step"] == 4
    other = tmp_path / "other.ckpt"
    trained(other, max_steps=2)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    for flags in ({}, {"resume_from_checkpoint": other}):
        trainer = cardcage.Trainer(
            default_root_dir=root, max_steps=6, progress_bar=False, max_epochs=2, **flags
        )
        resumed: list[int] = []
        model = Net()
        real_step = model.training_step

        def step(
            batch: Any, batch_idx: int, real: Any = real_step, seen: Any = resumed, t: Any = trainer
        ) -> Any:
            seen.append(t.global_step)
            return real(batch, batch_idx)

        model.training_step = step  # type: ignore[method-assign]
        trainer.fit(model, loader())
        assert resumed == [4, 5], flags  # from last.ckpt's step 4, not other.ckpt's step 2


# -- optimizer states ---------------------------------------------------------------------------


class Tuned(Net):
    """Net whose configure_optimizers returns SGD with momentum, or Adam, and, with
    ``groups=2``, the two layers as two parameter groups."""

    def __init__(self, optimizer: str = "sgd", groups: int = 1):
        super().__init__()
        self.optimizer, self.groups = optimizer, groups

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params: Any = self.parameters()
        if self.groups == 2:
            params = [{"params": self.net[0].parameters()}, {"params": self.net[2].parameters()}]
        if self.optimizer == "adam":
            return torch.optim.Adam(params, lr=0.01)
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def without_types(path: Path) -> None:
    """``path`` as a checkpoint that did not record its optimizers' classes."""
    state = checkpoint.load(path)
    del state["optimizer_types"]
    torch.save(state, path)


@pytest.mark.parametrize("recorded", [True, False], ids=["class recorded", "class inferred"])
@pytest.mark.parametrize(
    ("saved", "resumed", "says"),
    [
        ("sgd", "adam", "it holds a state of SGD, not of Adam"),
        ("adam", "sgd", "it holds a state of Adam, not of SGD"),
    ],
)
def test_an_optimizer_state_of_another_optimizer_is_refused_before_any_process(
    tmp_path: Path, saved: str, resumed: str, says: str, recorded: bool
) -> None:
    """An SGD state resumed into Adam (and Adam's into SGD) is refused in the calling
    process, naming the flag, the optimizer and what differs, before ddp_spawn starts a
    worker; torch itself would fail later, in a worker, with a bare KeyError."""
    path = tmp_path / "c.ckpt"
    trained(path, Tuned(saved), max_steps=2)
    if not recorded:
        without_types(path)
        adam_keys = "'amsgrad', 'betas'"
        says = f"lack Adam's {adam_keys}" if resumed == "adam" else "which SGD has not"
    trainer = cardcage.Trainer(
        distributed_backend="ddp_spawn",
        num_processes=2,
        progress_bar=False,
        resume_from_checkpoint=path,
    )
    kind = "Adam" if resumed == "adam" else "SGD"
    with watching_children() as started:
        begin = time.monotonic()
        with pytest.raises(cardcage.MisconfigurationError) as raised:
            trainer.fit(Tuned(resumed), loader())
        elapsed = time.monotonic() - begin
    message = str(raised.value)
    assert f"resume_from_checkpoint={str(path)!r} does not fit optimizer 0 ({kind})" in message
    assert says in message, message
    assert "Resume with the configure_optimizers() that wrote it" in message
    assert started == set() and elapsed < FAST_S


@pytest.mark.parametrize(
    ("saved", "resumed", "says"),
    [
        ({"groups": 2}, {}, "it holds 2 parameter group(s), SGD has 1"),
        ({}, {"groups": 2}, "it holds 1 parameter group(s), SGD has 2"),
    ],
)
def test_optimizer_states_of_other_parameter_groups_are_refused(
    tmp_path: Path, saved: dict[str, Any], resumed: dict[str, Any], says: str
) -> None:
    path = tmp_path / "c.ckpt"
    trained(path, Tuned(**saved), max_steps=2)
    trainer = cardcage.Trainer(progress_bar=False, resume_from_checkpoint=path)
    with pytest.raises(cardcage.MisconfigurationError) as raised:
        trainer.fit(Tuned(**resumed), loader())
    assert "does not fit optimizer 0 (SGD)" in str(raised.value)
    assert says in str(raised.value)
    assert trainer.global_step == 0


def test_an_optimizer_state_of_another_size_or_count_is_refused(tmp_path: Path) -> None:
    """Parameter groups of other sizes, and another number of optimizers, are named too."""
    path = tmp_path / "c.ckpt"
    trained(path, Tuned(groups=2), max_steps=2)
    state = checkpoint.load(path)
    groups = state["optimizers"][0]["param_groups"]
    groups[0]["params"], groups[1]["params"] = groups[0]["params"][:1], groups[1]["params"] + [3]
    torch.save(state, path)
    with pytest.raises(cardcage.MisconfigurationError, match="group 0 holds 1 parameter"):
        cardcage.Trainer(resume_from_checkpoint=path).fit(Tuned(groups=2), loader())
    torch.save({**state, "optimizers": state["optimizers"] * 2}, path)
    with pytest.raises(cardcage.MisconfigurationError, match=r"holds 2 optimizer state\(s\)"):
        cardcage.Trainer(resume_from_checkpoint=path).fit(Tuned(groups=2), loader())


@pytest.mark.parametrize("recorded", [True, False], ids=["class recorded", "class inferred"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_matching_optimizer_state_still_resumes(
    tmp_path: Path, optimizer: str, recorded: bool
) -> None:
    """The control: the same optimizer resumes and continues where the checkpoint left off,
    as one run without a stop would."""
    path = tmp_path / "c.ckpt"
    torch.manual_seed(0)
    trained(path, Tuned(optimizer), max_steps=3)
    if not recorded:
        without_types(path)
    resumed = Tuned(optimizer)
    cardcage.Trainer(progress_bar=False, max_steps=6, resume_from_checkpoint=path).fit(
        resumed, loader()
    )
    torch.manual_seed(0)
    whole = Tuned(optimizer)
    cardcage.Trainer(progress_bar=False, max_steps=6).fit(whole, loader())
    for key, value in whole.state_dict().items():
        assert torch.allclose(resumed.state_dict()[key], value, atol=1e-6), key


# -- ddp and ddp_spawn: no process starts --------------------------------------------------------


def test_ddp_spawn_starts_no_process_for_a_bad_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "bad.ckpt"
    path.write_bytes(bytes(range(256)))
    trainer = cardcage.Trainer(
        distributed_backend="ddp_spawn", num_processes=2, resume_from_checkpoint=path
    )
    with watching_children() as started:
        begin = time.monotonic()
        with pytest.raises(cardcage.MisconfigurationError, match="truncated or not a torch"):
            trainer.fit(Net(), loader())
        elapsed = time.monotonic() - begin
    assert started == set()
    assert elapsed < FAST_S


JOB = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path

    # Every process that runs this file says so: relaunched ddp ranks re-run it, spawned
    # ddp_spawn workers import it as __mp_main__.
    with open(os.environ["EARLY_STARTS"], "a") as starts:
        starts.write(f"{os.getpid()} {__name__}\\n")

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import cardcage


    class Net(torch.nn.Module):
        def __init__(self, hidden=8):
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
            )

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)


    def loader():
        x = torch.randn(32, 4, generator=torch.Generator().manual_seed(3))
        return DataLoader(TensorDataset(x, x[:, :1]), batch_size=4)


    def main():
        backend, cases, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
        results = {}
        for name, flags in cases.items():
            hidden = flags.pop("hidden", 8)
            begin = time.monotonic()
            try:
                trainer = cardcage.Trainer(
                    distributed_backend=backend, num_processes=2, progress_bar=False, **flags
                )
                trainer.fit(Net(hidden), loader())
                outcome = f"trained to step {trainer.global_step}"
            except cardcage.MisconfigurationError as error:
                outcome = f"MisconfigurationError: {error}"
            except BaseException as error:
                outcome = f"{type(error).__name__}: {error}"
            results[name] = {"outcome": outcome, "seconds": time.monotonic() - begin}
        if int(os.environ.get("RANK", "0")) == 0:
            Path(out).write_text(json.dumps(results))


    if __name__ == "__main__":
        main()
    """
)


def run_job(tmp_path: Path, backend: str, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Run JOB as a script of its own (ddp re-runs the script: under pytest that would be
    pytest); returns its results, and checks that no process of it is left."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    marker = f"early-checks-{uuid.uuid4().hex}"
    env = {k: v for k, v in os.environ.items() if k not in kit_harness.LAUNCHER_VARIABLES}
    env.update(
        {
            "EARLY_STARTS": str(tmp_path / "starts.txt"),
            kit_harness.MARKER: marker,
            "CUDA_VISIBLE_DEVICES": "",
        }
    )
    out = tmp_path / "results.json"
    try:
        job = subprocess.run(
            [sys.executable, str(script), backend, json.dumps(cases), str(out)],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        left = kit_harness.leftover_processes(marker)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {left}"
    assert job.returncode == 0, job.stderr
    results: dict[str, Any] = json.loads(out.read_text())
    results["starts"] = (tmp_path / "starts.txt").read_text().splitlines()
    return results


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ddp", "ddp_spawn"])
def test_bad_inputs_fail_in_the_calling_process_before_any_rank_starts(
    tmp_path: Path, backend: str, good_state: dict[str, Any]
) -> None:
    files = tmp_path / "files"
    files.mkdir()
    (files / "empty.ckpt").write_bytes(b"")
    torch.save(good_state, files / "good.ckpt")
    data = (files / "good.ckpt").read_bytes()
    (files / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    torch.save({**good_state, "extra": Payload()}, files / "pickled.ckpt")
    (files / "a-file").write_text("not a folder")
    cases: dict[str, dict[str, Any]] = {
        "empty": {"resume_from_checkpoint": str(files / "empty.ckpt")},
        "truncated": {"resume_from_checkpoint": str(files / "truncated.ckpt")},
        "pickled": {"resume_from_checkpoint": str(files / "pickled.ckpt")},
        "shapes": {"resume_from_checkpoint": str(files / "good.ckpt"), "hidden": 16},
        "root is a file": {"default_root_dir": str(files / "a-file")},
        "root under /proc": {"default_root_dir": "/proc/cardcage-early/runs"},
    }
    says = {
        "empty": "is empty (0 bytes)",
        "truncated": "is truncated or not a torch file",
        "pickled": "refused by torch.load(weights_only=True)",
        "shapes": "does not fit the model",
        "root is a file": "is a file, not a folder",
        "root under /proc": "is not writable",
    }
    results = run_job(tmp_path, backend, cases)
    for name in cases:
        outcome = results[name]["outcome"]
        assert outcome.startswith("MisconfigurationError: "), (name, outcome)
        assert says[name] in outcome, (name, outcome)
        assert results[name]["seconds"] < FAST_S, (name, results[name])
    # Only the script's own process ran it: no relaunched rank, no spawned worker.
    assert len(results["starts"]) == 1, results["starts"]


@pytest.mark.slow
def test_a_good_checkpoint_still_resumes_under_ddp(
    tmp_path: Path, good_state: dict[str, Any]
) -> None:
    """The control of the test above: with a good checkpoint, rank 1 is started (it runs
    the script too) and both ranks resume from it."""
    torch.save(good_state, tmp_path / "good.ckpt")
    cases = {"good": {"resume_from_checkpoint": str(tmp_path / "good.ckpt"), "max_epochs": 2}}
    results = run_job(tmp_path, "ddp", cases)
    steps_per_epoch = good_state["global_step"]  # one epoch of 8 batches on one process
    # Two ranks split each epoch: the second epoch adds half as many steps.
    assert results["good"]["outcome"] == f"trained to step {steps_per_epoch * 3 // 2}", results
    assert len(results["starts"]) == 2, results["starts"]


# -- writes that fail ---------------------------------------------------------------------------


def assert_write_error(error: BaseException, path: Path, code: int, cause: str) -> None:
    assert isinstance(error, cardcage.CheckpointError) and isinstance(error, OSError)
    assert error.errno == code and error.path == str(path)
    assert f"could not write checkpoint {path}: {cause} (errno {code})" in str(error)
    assert "unexpected pos" not in str(error)


def test_a_full_disk_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    with tiny_tmpfs(tmp_path / "disk") as disk:
        path = disk / "model.ckpt"
        trainer = trained(path)  # a few KiB: fits
        saved = path.read_bytes()
        big = cardcage.Trainer(progress_bar=False)
        big.fit(Net(ballast=40_000), loader())  # 160 KB of buffer: does not fit
        with pytest.raises(OSError) as raised:  # except OSError still catches it
            big.save_checkpoint(path)
        assert_write_error(raised.value, path, errno.ENOSPC, "no space left on device")
        assert "the previous checkpoint there is unchanged" in str(raised.value)
        assert "free space on that disk" in str(raised.value)
        assert path.read_bytes() == saved  # whole, and still the old one
        assert checkpoint.load(path)["global_step"] == trainer.global_step
        assert sorted(p.name for p in disk.iterdir()) == ["model.ckpt"]  # no partial file


def test_a_full_disk_during_step_checkpoints_fails_naming_last_ckpt(tmp_path: Path) -> None:
    with tiny_tmpfs(tmp_path / "disk") as disk:
        cardcage.Trainer(
            default_root_dir=disk, checkpoint_every_n_steps=2, max_steps=3, progress_bar=False
        ).fit(Net(), loader())
        before = (disk / "last.ckpt").read_bytes()
        trainer = cardcage.Trainer(
            default_root_dir=disk, checkpoint_every_n_steps=2, max_steps=4, progress_bar=False
        )
        with pytest.raises(cardcage.CheckpointError) as raised:
            trainer.fit(Net(ballast=40_000), loader())
        assert_write_error(
            raised.value, disk / "last.ckpt", errno.ENOSPC, "no space left on device"
        )
        assert trainer.global_step == 2  # at the first step checkpoint
        assert (disk / "last.ckpt").read_bytes() == before
        assert sorted(p.name for p in disk.iterdir()) == ["last.ckpt", "logs"]
        # each fit claimed its logger's version folder when it started; nothing else is left
        assert files_below(disk / "logs") == ["version_0", "version_1"]


def test_sdk_save_checkpoint_file_on_a_full_disk(tmp_path: Path) -> None:
    with tiny_tmpfs(tmp_path / "disk") as disk:
        fill(disk)
        with pytest.raises(cardcage.CheckpointError) as raised:
            sdk.save_checkpoint_file({"w": torch.zeros(1000)}, disk / "new.ckpt")
        assert_write_error(raised.value, disk / "new.ckpt", errno.ENOSPC, "no space left on device")
        assert "nothing was written there" in str(raised.value)
        assert sorted(p.name for p in disk.iterdir()) == ["ballast"]


def test_a_read_only_disk_is_named(tmp_path: Path) -> None:
    with tiny_tmpfs(tmp_path / "ro", "size=64k,ro") as disk:
        with pytest.raises(cardcage.CheckpointError) as raised:
            checkpoint.save_atomic({"w": torch.zeros(10)}, disk / "c.ckpt")
        assert_write_error(raised.value, disk / "c.ckpt", errno.EROFS, "read-only file system")
        assert "mounted read-only" in str(raised.value)


# -- logger files -----------------------------------------------------------------------------


@pytest.mark.parametrize("below", [False, True], ids=["the-mount", "a-folder-to-make"])
def test_a_logger_on_a_read_only_disk_is_refused_when_made(tmp_path: Path, below: bool) -> None:
    """Refused naming the logger, the flag and the folder when the logger is built, before
    any fit (before: accepted, then a raw OSError once training had started)."""
    with tiny_tmpfs(tmp_path / "ro", "size=64k,ro") as disk:
        target = disk / "runs" if below else disk
        for cls in (CSVLogger, TensorBoardLogger):
            with pytest.raises(cardcage.MisconfigurationError) as raised:
                cls(save_dir=target)
            message = str(raised.value)
            assert f"{cls.__name__}(save_dir={str(target)!r}) is not writable" in message
            assert f"read-only file system (errno {errno.EROFS})" in message


def test_a_full_disk_under_metrics_csv_names_the_file_and_leaves_no_tmp(tmp_path: Path) -> None:
    """A new column (the file written again) and an appended row on a full disk: an
    OSError naming metrics.csv and the fix, the file as it was, no temporary file left
    (before: a raw '[Errno 28] No space left on device' without a path, and a .tmp)."""
    with tiny_tmpfs(tmp_path / "disk") as disk:
        logger = CSVLogger(disk)
        wide = {f"metric_{i:04d}": 0.123456789 for i in range(600)}  # a row of about 8 KB
        logger.log_metrics(wide, step=0)
        path = Path(logger.log_dir) / "metrics.csv"
        written = path.read_bytes()
        fill(disk)
        for metrics, step in (({**wide, "new": 1.0}, 1), (wide, 2)):
            with pytest.raises(OSError) as raised:
                logger.log_metrics(metrics, step=step)
            assert raised.value.errno == errno.ENOSPC
            assert f"could not write {path}: no space left on device" in str(raised.value)
            assert "Fix: free space on that disk" in str(raised.value)
            assert path.read_bytes() == written
            assert files_below(Path(logger.log_dir)) == ["metrics.csv"]  # no .tmp left
            logger.experiment.metrics.pop()  # the row that was not written
            logger.experiment.columns[:] = ["step", *wide]


def test_a_full_disk_under_hparams_yaml_names_the_file(tmp_path: Path) -> None:
    with tiny_tmpfs(tmp_path / "disk") as disk:
        logger = CSVLogger(disk)
        logger.log_metrics({"x": 1.0}, step=0)
        folder = Path(logger.log_dir)
        fill(disk)
        with pytest.raises(OSError) as raised:
            logger.log_hyperparams({"notes": "x" * 20_000})
        assert f"could not write {folder / 'hparams.yaml'}: no space left" in str(raised.value)
        assert files_below(folder) == ["metrics.csv"]  # no .tmp left


def test_a_path_that_is_not_a_file_is_not_replaced(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(cardcage.CheckpointError, match="a device, pipe or socket, not a file"):
        checkpoint.save_atomic({"w": torch.zeros(10)}, fifo)
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    with pytest.raises(cardcage.CheckpointError, match="it is a folder, not a file"):
        checkpoint.save_atomic({"w": torch.zeros(10)}, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_checkpoint_error_survives_pickling() -> None:
    error = cardcage.CheckpointError("could not write checkpoint /x: no space", "/x", 28)
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.path, copy.errno) == (str(error), "/x", 28)
    assert "CheckpointError" in cardcage.__all__


# -- the requeue checkpoint on a full disk --------------------------------------------------------

WORKER = Path(__file__).resolve().parents[1] / "slurm" / "scripts" / "requeue_worker.py"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.slow
def test_a_requeue_checkpoint_on_a_full_disk_fails_every_rank_now(tmp_path: Path) -> None:
    """Two ranks (SLURM's variables, a fake scontrol), SIGUSR1 at step 30: rank 0 cannot
    write the requeue checkpoint, so the job is not requeued and both ranks fail at once
    with the cause (rank 1 gets it from rank 0 through the store, as it gets the result of a
    requeue)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.log\n')
    scontrol.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CARDCAGE_"))}
    for name in kit_harness.LAUNCHER_VARIABLES:
        base.pop(name, None)
    with tiny_tmpfs(tmp_path / "disk") as disk:
        fill(disk)
        base.update(
            {
                "PATH": f"{bin_dir}{os.pathsep}{base.get('PATH', '')}",
                "SLURM_JOB_ID": "77",
                "SLURM_JOB_NAME": "worker",
                "SLURM_NTASKS": "2",
                "SLURM_NODEID": "0",
                "SLURM_NODELIST": "localhost",
                "SLURM_SUBMIT_DIR": str(tmp_path),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port()),
                requeue.REQUEUE_DIR: str(disk),
            }
        )
        command = [
            sys.executable,
            str(WORKER),
            "--num-processes",
            "2",
            "--signal-step",
            "30",
            "--out",
            str(tmp_path / "weights.pt"),
        ]
        begin = time.monotonic()
        ranks = [
            subprocess.Popen(
                command,
                env={**base, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)},
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(2)
        ]
        try:
            outputs = [rank.communicate(timeout=120) for rank in ranks]
        finally:
            for rank in ranks:
                if rank.poll() is None:
                    rank.kill()
                    rank.wait()
        elapsed = time.monotonic() - begin
        left = sorted(p.name for p in disk.iterdir())
    logs = "\n".join(err for _, err in outputs)
    assert [rank.returncode for rank in ranks] == [1, 1], logs
    path = disk / "cardcage-requeue-77.ckpt"
    expected = (
        f"CheckpointError: job 77 was not requeued: could not write checkpoint {path}: no "
        f"space left on device (errno {errno.ENOSPC})"
    )
    for _, err in outputs:
        assert expected in err, logs
    assert not (tmp_path / "scontrol.log").exists()  # not requeued
    assert left == ["ballast"]  # no partial file
    assert elapsed < 90, logs
