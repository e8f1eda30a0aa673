"""A restart resumes only from a checkpoint its own run wrote.

``default_root_dir`` already holds a ``last.ckpt`` that an earlier run left there (the same
model trained with another learning rate, or a model of another shape). This run checkpoints
too rarely to have written one when rank 1 is SIGKILLed at step 7, so its restart must start
over: its final weights equal those of the same job run in an empty folder, the other run's
file is never loaded (a file of another shape would fail ``load_state_dict``) nor changed,
and one warning names it. Covered: cardcage's own restart of spawned workers (``ddp_spawn``)
and of a relaunched script (``ddp``), and torchrun's ``--max-restarts``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

from cardcage.testing.harness import Harness

JOB = Path(__file__).parent / "scripts" / "restart_job.py"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
#: This run writes no checkpoint before rank 1 dies at step 7 (8 steps in all).
RARELY = "every=100"

pytestmark = pytest.mark.slow


def command(out: Path, backend: str, mode: str, *options: str, torchrun: bool) -> list[str]:
    job = [str(JOB), str(out), backend, mode, "1", *options]
    if torchrun:
        return [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", *job]
    return [sys.executable, *job]


def run_job(
    harness: Harness, out: Path, backend: str, mode: str, *options: str, torchrun: bool = False
) -> str:
    """Run the job to its end (exit 0) and return its stderr."""
    out.mkdir(parents=True, exist_ok=True)
    job = harness.start(command(out, backend, mode, *options, torchrun=torchrun))
    job.check()
    harness.assert_no_leftovers()
    return job.stderr


def weights(out: Path) -> list[float]:
    loaded: list[float] = json.loads((out / "result.json").read_text())["weights"]
    return loaded


@pytest.fixture(scope="module")
def stale(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``last.ckpt`` files that earlier runs left: the same model trained with another
    learning rate, and a model with a wider hidden layer."""
    harness = Harness(tmp_path_factory.mktemp("stale"))
    files = {}
    try:
        for name, option in [("same shape", "lr=0.05"), ("another shape", "hidden=32")]:
            out = harness.root / name.replace(" ", "-")
            run_job(harness, out, "ddp_spawn", "straight", option, f"root={out / 'root'}")
            files[name] = out / "root" / "last.ckpt"
            assert files[name].is_file()
    finally:
        assert not harness.cleanup()
    return files


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], list[float]]:
    """The final weights of each launcher's job, rank 1 killed once, in an empty folder."""
    harness = Harness(tmp_path_factory.mktemp("fresh"))
    found = {}
    try:
        for backend, torchrun in [("ddp_spawn", False), ("ddp", False), ("ddp", True)]:
            out = harness.root / f"{backend}-{torchrun}"
            root = f"root={out / 'root'}"
            run_job(harness, out, backend, "once", RARELY, root, torchrun=torchrun)
            assert (out / "killed").exists()
            found[backend, torchrun] = weights(out)
    finally:
        assert not harness.cleanup()
    return found


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    ("backend", "torchrun", "shape"),
    [
        ("ddp_spawn", False, "same shape"),
        ("ddp_spawn", False, "another shape"),
        ("ddp", False, "same shape"),
        ("ddp", True, "same shape"),
        ("ddp", True, "another shape"),
    ],
    ids=["ddp_spawn-same", "ddp_spawn-other", "ddp-same", "torchrun-same", "torchrun-other"],
)
def test_a_restart_never_resumes_from_another_runs_checkpoint(
    stale: dict[str, Path],
    fresh: dict[tuple[str, bool], list[float]],
    tmp_path: Path,
    backend: str,
    torchrun: bool,
    shape: str,
) -> None:
    out = tmp_path / "out"
    root = out / "root"
    root.mkdir(parents=True)
    last = root / "last.ckpt"
    shutil.copy(stale[shape], last)
    before = digest(last)
    harness = Harness(tmp_path)
    try:
        stderr = run_job(harness, out, backend, "once", RARELY, f"root={root}", torchrun=torchrun)
    finally:
        assert not harness.cleanup()
    assert (out / "killed").exists()  # rank 1 did die, and the job was restarted
    if not torchrun:
        assert "restart 1 of max_restarts=1, from the start" in stderr
    assert f"{last} was written by another run" in stderr
    # Said once, by the first attempt; torchrun's second attempt is a new fit of its own job.
    assert stderr.count(f"{last} was written by another run") == 1 + torchrun
    assert weights(out) == fresh[backend, torchrun]  # the other run's weights never came in
    assert digest(last) == before  # left as it was
