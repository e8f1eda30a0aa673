"""Training with Horovod itself: under horovodrun, and with cardcage starting the workers.

Skipped, with the reason, where ``horovod.torch`` cannot be imported or has no Gloo: ``nox -s
horovod`` builds Horovod for the installed torch (``python -m cardcage_horovod.build``) and runs
these. Under CI (``CI`` set) they fail with that reason instead: the session exists for them.

The reference everywhere is a plain PyTorch loop in one process on batches twice as large (two
processes of batch 8 on unshuffled data see what one process of batch 16 sees).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch


def _problem() -> str | None:
    try:
        import horovod.torch as hvd
    except Exception as error:
        return (
            f"horovod.torch cannot be imported ({type(error).__name__}: {error}); "
            "`nox -s horovod` builds Horovod for this torch and runs these tests"
        )
    if not hvd.gloo_built():
        return "this Horovod was built without Gloo (HOROVOD_WITH_GLOO=1)"
    return None


PROBLEM = _problem()
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def horovod_with_gloo() -> None:
    """Skip with the problem; under CI, fail with it (the horovod session exists to run these)."""
    if PROBLEM is not None:
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(f"under CI: {PROBLEM}", pytrace=False)
        pytest.skip(PROBLEM)


ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "horovod" / "train.py"
HOROVODRUN = [sys.executable, "-c", "from horovod.runner.launch import run_commandline as r; r()"]
TOLERANCE = 1e-5
ENDS_WITHIN_S = 30.0


def example() -> Any:
    spec = importlib.util.spec_from_file_location("cardcage_horovod_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference(*, scale_lr: bool, clip: float | None = None, processes: int = 2) -> dict[str, Any]:
    args = argparse.Namespace(
        lr=0.05, batch_size=8, epochs=3, processes=processes, no_scale_lr=not scale_lr, clip=clip
    )
    state: dict[str, Any] = example().reference(args).state_dict()
    return state


def max_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def run(command: list[Any], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CARDCAGE_HOROVOD_SCALE_LR", None)
    result = subprocess.run(
        [str(c) for c in command],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    return result


def horovodrun(*args: Any, np: int = 2) -> list[Any]:
    return [*HOROVODRUN, "--gloo", "-np", np, "-H", f"localhost:{np}", sys.executable, *args]


def example_line(stdout: str) -> dict[str, Any]:
    """The one ``cardcage-example:`` line of a run (horovodrun prefixes ``[0]<stdout>:``),
    its weights as tensors."""
    mark = "cardcage-example: "
    lines = [json.loads(line.partition(mark)[2]) for line in stdout.splitlines() if mark in line]
    assert len(lines) == 1, stdout
    line: dict[str, Any] = lines[0]
    line["weights"] = {k: torch.tensor(v) for k, v in line["weights"].items()}
    return line


def weights(path: Path) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(path, weights_only=True)
    return state


@pytest.mark.parametrize("scale_lr", [False, True], ids=["lr-as-configured", "lr-scaled"])
@pytest.mark.parametrize("launcher", ["horovodrun", "trainer"])
def test_two_processes_train_like_one_process_on_twice_the_batch(
    tmp_path: Path, launcher: str, scale_lr: bool
) -> None:
    out = tmp_path / "weights.pt"
    flags = [EXAMPLE, "--out", out, *([] if scale_lr else ["--no-scale-lr"])]
    if launcher == "horovodrun":
        command = horovodrun(*flags)
    else:  # Trainer(distributed_backend="horovod", num_processes=2) under plain python
        command = [sys.executable, *flags, "--num-processes", "2"]
    started = time.monotonic()
    result = run(command, tmp_path)
    seconds = time.monotonic() - started
    assert "horovod: 2 process(es)" in result.stdout
    trained = weights(out)
    expected = reference(scale_lr=scale_lr)  # at twice the learning rate when scaled
    printed = example_line(result.stdout)  # rank 0's cardcage-example: line
    assert (printed["accelerator"], printed["world_size"], printed["rank"]) == ("horovod", 2, 0)
    assert max_difference(printed["weights"], expected) < TOLERANCE
    other = reference(scale_lr=not scale_lr)
    difference = max_difference(trained, expected)
    print(
        f"\n{launcher}, {'scaled' if scale_lr else 'unscaled'} lr: max |w - reference| = "
        f"{difference:.3g} ({seconds:.1f} s); against the other lr: "
        f"{max_difference(trained, other):.3g}"
    )
    assert difference < TOLERANCE
    assert max_difference(trained, other) > 100 * TOLERANCE  # the learning rate mattered


def test_gradients_are_averaged_before_on_after_backward_clips_them(tmp_path: Path) -> None:
    out = tmp_path / "weights.pt"
    run(horovodrun(EXAMPLE, "--out", out, "--no-scale-lr", "--clip", "0.05"), tmp_path)
    trained = weights(out)
    clipped = reference(scale_lr=False, clip=0.05)
    difference = max_difference(trained, clipped)
    print(f"\nclipped at 0.05: max |w - reference| = {difference:.3g}")
    assert difference < TOLERANCE
    assert max_difference(clipped, reference(scale_lr=False)) > 100 * TOLERANCE


def test_the_trainer_launches_from_a_test_process_and_takes_rank_0s_results(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import signal

    import cardcage

    module = example()  # loaded from a file path: workers cannot import it by name
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setenv("CARDCAGE_HOROVOD_SCALE_LR", "0")
    model = module.Regressor()
    trainer = cardcage.Trainer(
        distributed_backend="horovod", num_processes=2, max_epochs=3, progress_bar=False
    )
    # What the test process had (Python's handler, or SIG_IGN when pytest was started in the
    # background of a non-interactive shell, which ignores SIGINT for it).
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    trainer.fit(model)
    assert max_difference(model.state_dict(), reference(scale_lr=False)) < TOLERANCE
    assert trainer.global_step == 3 * 16  # 256 samples / 2 processes / batch 8, 3 epochs
    assert trainer.current_epoch == 3 and "val_loss" in trainer.logged_metrics
    assert len(trainer.losses) == trainer.global_step
    # horovod.run's signal handlers did not outlive the run.
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_one_process_trains_in_the_calling_process(tmp_path: Path) -> None:
    out = tmp_path / "weights.pt"
    result = run([sys.executable, EXAMPLE, "--out", out], tmp_path)
    assert "horovod: 1 process(es)" in result.stdout
    assert max_difference(weights(out), reference(scale_lr=True, processes=1)) < TOLERANCE


FAILING = """
import os, sys, time
sys.path.insert(0, {example_dir!r})
import cardcage
from train import Regressor

class Failing(Regressor):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2 and os.environ.get("HOROVOD_RANK") == "1":
            print(f"FAILING AT {{time.time()}}", file=sys.stderr, flush=True)
            raise RuntimeError("rank 1 fails on purpose")
        return super().training_step(batch, batch_idx)

if __name__ == "__main__":
    trainer = cardcage.Trainer(
        distributed_backend="horovod", num_processes=int(sys.argv[1]), max_epochs=100
    )
    trainer.fit(Failing())
"""


def tagged_processes(tag: str) -> list[int]:
    """The live processes whose environment holds ``tag`` (this job's, and nothing else)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if tag.encode() in environ and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.mark.parametrize("launcher", ["horovodrun", "trainer"])
def test_a_rank_that_raises_ends_the_whole_job(tmp_path: Path, launcher: str) -> None:
    script = tmp_path / "failing.py"
    script.write_text(FAILING.format(example_dir=str(EXAMPLE.parent)))
    # Under horovodrun the script trains in each of its 2 processes; otherwise it starts 2.
    command = horovodrun(script, "1") if launcher == "horovodrun" else [sys.executable, script, "2"]
    tag = f"cardcage-test-{uuid.uuid4().hex}"
    env = {**os.environ, "CARDCAGE_TEST_TAG": tag, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [str(c) for c in command],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            process.kill()
    ended = time.time()
    failed_at = re.search(r"FAILING AT ([\d.]+)", stderr)
    assert failed_at, f"{stdout}\n{stderr}"
    seconds = ended - float(failed_at.group(1))
    deadline = time.monotonic() + 5
    while tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = tagged_processes(tag)
    print(f"\n{launcher}: exit {process.returncode}, ended {seconds:.1f} s after the failure")
    assert process.returncode != 0
    assert seconds < ENDS_WITHIN_S
    assert "rank 1 fails on purpose" in stderr
    if launcher == "trainer":
        assert "RankFailedError: rank 1 exited with status 1" in stderr
    assert left == [], f"processes left: {left}"


UNEVEN = """
import os, sys
sys.path.insert(0, {example_dir!r})
import cardcage, torch
from torch.utils.data import DataLoader
from train import Regressor, dataset

class Uneven(Regressor):
    def train_dataloader(self):
        samples = 64 if os.environ["HOROVOD_RANK"] == "0" else 96
        return DataLoader(dataset(samples), batch_size=8)

trainer = cardcage.Trainer(distributed_backend="horovod", replace_sampler_ddp=False, max_epochs=2)
model = Uneven()
trainer.fit(model)
torch.save(model.state_dict(), f"rank-{{trainer.accelerator.global_rank}}.pt")
"""


def test_uneven_data_joins_instead_of_hanging_and_the_ranks_stay_equal(tmp_path: Path) -> None:
    script = tmp_path / "uneven.py"
    script.write_text(textwrap.dedent(UNEVEN.format(example_dir=str(EXAMPLE.parent))))
    result = run(horovodrun(script), tmp_path, timeout=180)
    assert "uneven numbers of batches" in result.stderr
    assert "rank 0: 8, rank 1: 12" in result.stderr
    assert max_difference(weights(tmp_path / "rank-0.pt"), weights(tmp_path / "rank-1.pt")) == 0


SCHEDULED = """
import sys, warnings
sys.path.insert(0, {example_dir!r})
warnings.simplefilter("error", UserWarning)  # torch's scheduler-order warnings fail the run
import cardcage, torch
from train import Regressor

class Scheduled(Regressor):
    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)]

def fit(**flags):
    trainer = cardcage.Trainer(distributed_backend="horovod", progress_bar=False, **flags)
    trainer.fit(Scheduled())
    return trainer, trainer.optimization.optimizers[0].param_groups[0]["lr"]

first, lr_first = fit(max_epochs=2)
first.save_checkpoint("resume.ckpt")
second, lr_second = fit(max_epochs=4, resume_from_checkpoint="resume.ckpt")
if second.accelerator.is_global_zero:
    print(f"LR {{lr_first:.6g}} {{lr_second:.6g}}")
"""


def test_schedulers_drive_the_wrapped_optimizers_across_a_resume(tmp_path: Path) -> None:
    script = tmp_path / "scheduled.py"
    script.write_text(SCHEDULED.format(example_dir=str(EXAMPLE.parent)))
    result = run(horovodrun(script), tmp_path)
    found = re.search(r"LR ([\d.e-]+) ([\d.e-]+)", result.stdout)
    assert found, result.stdout + result.stderr
    # 0.05 x 2 processes, halved after each epoch: 2 epochs, then 2 more after the resume.
    assert float(found.group(1)) == pytest.approx(0.1 * 0.5**2)
    assert float(found.group(2)) == pytest.approx(0.1 * 0.5**4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="precision=16 needs a CUDA GPU")
def test_mixed_precision_steps_through_the_scaler_after_synchronising(tmp_path: Path) -> None:
    script = tmp_path / "amp.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(EXAMPLE.parent)!r})
            import cardcage
            from train import Regressor
            trainer = cardcage.Trainer(
                distributed_backend="horovod", gpus=1, precision=16, max_epochs=2
            )
            trainer.fit(Regressor(clip=0.05))
            print("steps", trainer.global_step)
            """
        )
    )
    result = run(horovodrun(script, np=min(2, torch.cuda.device_count())), tmp_path)
    assert "steps" in result.stdout
