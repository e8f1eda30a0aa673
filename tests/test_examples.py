"""The examples in examples/ run the way their docstrings (and examples/README.md) say a user
runs them, each as real processes: ``python examples/plain/train.py``, ``python
examples/ddp/train.py`` (cardcage re-runs the script for rank 1) and ``torchrun --standalone
--nproc_per_node=2 examples/torchrun/train.py`` (as ``python -m torch.distributed.run``).

Every process that trains prints one ``cardcage-example:`` JSON line with its rank, what was
selected and its final weights. Those must equal, within 1e-5, the weights of the example's own
``reference()``: a plain PyTorch loop in this process, on batches as large as all the ranks'
batches of a step together (the data is not shuffled). The examples' environment has no
launcher's or cardcage's variables, and no process they start may outlive them.

The SLURM example runs in tests/slurm (``nox -s slurm``), the Horovod one in
plugins/horovod/tests (``nox -s horovod``), the TPU one in plugins/tpu/tests (``nox -s tpu``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
PYTHON = sys.executable
MARK = "cardcage-example: "
MARKER = "CARDCAGE_TEST_MARKER"
#: Seconds an example may take on a loaded two-core machine (importing torch dominates).
TIMEOUT = 180.0
TOLERANCE = 1e-5
#: The examples' defaults: 256 samples, 2 epochs, 16 samples per step over all the ranks.
SAMPLES, EPOCHS, STEP_BATCH = 256, 2, 16
#: Variables that steer a launcher or cardcage: none of them may reach the examples.
STEERING = {
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "NODE_RANK",
    "OMP_NUM_THREADS",
}
STEERING_PREFIXES = (
    "CARDCAGE_",
    "PL_TRAINER_",
    "TORCHELASTIC_",
    "SLURM_",
    "HOROVOD_",
    "OMPI_",
    "PMI_",
    "PMIX_",
)


@dataclass(frozen=True)
class Example:
    command: list[str]
    ranks: int
    #: What each rank's line must say: accelerator, rule, and cluster by rank.
    accelerator: str
    rule: str
    clusters: tuple[str, ...]


EXAMPLE_RUNS = {
    "plain": Example(
        [PYTHON, str(EXAMPLES / "plain" / "train.py")], 1, "cpu", "cpu_fallback", ("local",)
    ),
    # Rank 0 is the process started here (a local launch); rank 1 its relaunch (env://).
    "ddp": Example(
        [PYTHON, str(EXAMPLES / "ddp" / "train.py")],
        2,
        "ddp",
        "distributed_backend",
        ("local", "torchelastic"),
    ),
    "torchrun": Example(
        [
            PYTHON,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(EXAMPLES / "torchrun" / "train.py"),
        ],
        2,
        "ddp",
        "multi_node_or_cluster",
        ("torchelastic", "torchelastic"),
    ),
}


def load_example(name: str) -> ModuleType:
    """``examples/<name>/train.py`` as a module (for its ``reference()``)."""
    spec = importlib.util.spec_from_file_location(
        f"cardcage_example_{name}", EXAMPLES / name / "train.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def clean_env(marker: str, tmpdir: Path) -> dict[str, str]:
    """This environment without steering variables, plus the marker and a private TMPDIR."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in STEERING and not key.startswith(STEERING_PREFIXES)
    }
    env.update({MARKER: marker, "TMPDIR": str(tmpdir), "PYTHONUNBUFFERED": "1"})
    env["PYTHONFAULTHANDLER"] = "1"
    return env


def marked_processes(marker: str) -> dict[int, str]:
    """Live processes whose environment holds ``marker``: the example's, and nothing else."""
    found = {}
    needle = f"{MARKER}={marker}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        base = Path("/proc") / entry
        try:
            if (base / "stat").read_text().rpartition(")")[2].split()[0] in ("Z", "X"):
                continue
            if needle in (base / "environ").read_bytes():
                found[int(entry)] = (base / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
    return found


@dataclass
class Run:
    """An example started in its own session, with its output in files and its marker."""

    name: str
    popen: subprocess.Popen[bytes]
    folder: Path
    marker: str
    started: float
    ended: threading.Event
    seconds: float | None = None

    @classmethod
    def start(cls, name: str, folder: Path, command: list[str] | None = None) -> Run:
        folder.mkdir(parents=True)
        (folder / "tmp").mkdir()
        marker = f"cardcage-example-{name}-{uuid.uuid4().hex}"
        with (folder / "stdout").open("wb") as out, (folder / "stderr").open("wb") as err:
            popen = subprocess.Popen(
                command or EXAMPLE_RUNS[name].command,
                cwd=folder,
                env=clean_env(marker, folder / "tmp"),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,  # a timeout kills the whole session
            )
        run = cls(name, popen, folder, marker, time.monotonic(), threading.Event())
        threading.Thread(target=run._watch, daemon=True).start()
        return run

    def _watch(self) -> None:
        self.popen.wait()
        self.seconds = time.monotonic() - self.started
        self.ended.set()

    def output(self) -> str:
        out = (self.folder / "stdout").read_text(errors="replace")
        err = (self.folder / "stderr").read_text(errors="replace")
        return f"--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-6000:]}"

    def finish(self) -> list[dict[str, Any]]:
        """Wait for the example, check that it exited 0 and left nothing behind; return the
        ``cardcage-example:`` lines it printed."""
        if not self.ended.wait(max(TIMEOUT - (time.monotonic() - self.started), 1)):
            self.kill()
            pytest.fail(f"{self.name} did not end within {TIMEOUT:.0f}s (killed)\n{self.output()}")
        code = self.popen.returncode
        assert code == 0, f"{self.name} exited {code}\n{self.output()}"
        deadline = time.monotonic() + 10
        left = marked_processes(self.marker)
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = marked_processes(self.marker)
        self.kill()
        assert not left, f"{self.name} left processes behind: {left}"
        # cardcage's own (torch leaves its caches, and torchrun its log folder, by design).
        folders = sorted(p.name for p in (self.folder / "tmp").glob("cardcage-*"))
        assert not folders, f"{self.name} left temporary folders behind: {folders}"
        stdout = (self.folder / "stdout").read_text()
        return [
            json.loads(line[len(MARK) :]) for line in stdout.splitlines() if line.startswith(MARK)
        ]

    def kill(self) -> None:
        """SIGKILL the session and any marked process still alive."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        for pid in marked_processes(self.marker):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)


def selected_params(request: pytest.FixtureRequest, param: str) -> set[Any]:
    """The values of ``param`` among the collected tests of this module."""
    return {
        item.callspec.params[param]
        for item in request.session.items
        if getattr(item, "module", None) is request.module
        and param in getattr(getattr(item, "callspec", None), "params", {})
    }


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Start every selected example at once (most of a run is waiting for torch to import);
    each test then waits for its own."""
    selected = selected_params(request, "name")
    root = tmp_path_factory.mktemp("examples")
    started = {name: Run.start(name, root / name) for name in sorted(selected)}
    yield started
    for run in started.values():
        run.kill()


def weights_of(line: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {key: torch.tensor(value) for key, value in line["weights"].items()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[key].double() - b[key].double()).abs().max()) for key in a)


@pytest.mark.parametrize("name", sorted(EXAMPLE_RUNS))
def test_example_ends_with_the_weights_of_its_reference_loop(
    name: str, runs: dict[str, Run]
) -> None:
    run = runs[name]
    lines = run.finish()
    expected = EXAMPLE_RUNS[name]
    output = run.output()
    assert sorted(line["rank"] for line in lines) == list(range(expected.ranks)), output
    assert len({line["pid"] for line in lines}) == expected.ranks, output

    example = load_example(name)
    reference = example.reference(STEP_BATCH, EPOCHS, SAMPLES)
    # The check can tell: training moved the weights, and the step's batch size mattered
    # (N ranks that each trained on all the data would end at the batch-8 weights).
    assert max_difference(reference, example.Regressor().state_dict()) > 100 * TOLERANCE
    assert max_difference(reference, example.reference(8, EPOCHS, SAMPLES)) > 100 * TOLERANCE
    for line in sorted(lines, key=lambda line: line["rank"]):
        rank = line["rank"]
        assert line["example"] == name
        assert (line["accelerator"], line["rule"]) == (expected.accelerator, expected.rule)
        assert line["cluster"] == expected.clusters[rank], line["cluster"]
        assert line["world_size"] == expected.ranks
        assert line["global_step"] == EPOCHS * SAMPLES // STEP_BATCH
        difference = max_difference(weights_of(line), reference)
        print(f"{name} rank {rank}: max |w - reference| = {difference:.3g} ({run.seconds:.1f}s)")
        assert difference <= TOLERANCE, f"rank {rank} differs by {difference:g}\n{output}"

    by_rank = {line["rank"]: line for line in lines}
    if name in ("plain", "ddp"):  # the process started here trains as rank 0
        assert by_rank[0]["pid"] == run.popen.pid
    else:  # torchrun's workers train; the agent does not
        assert run.popen.pid not in {line["pid"] for line in lines}


# -- examples/lightning_style.py: a cardcage.Module with self.log, validation, a step
# scheduler, accumulation, clipping, ModelCheckpoint and EarlyStopping, on each backend.

LIGHTNING = str(EXAMPLES / "lightning_style.py")
#: The example's defaults: samples per process per step, and the most epochs.
LIGHTNING_BATCH, LIGHTNING_EPOCHS = 8, 10


@dataclass(frozen=True)
class LightningRun:
    command: list[str]
    ranks: int
    accelerator: str
    #: Processes that print a line: the training processes, or the caller alone (spawn).
    lines: int


TORCHRUN = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _backend(name: str, processes: int) -> list[str]:
    return [LIGHTNING, "--distributed-backend", name, "--num-processes", str(processes)]


LIGHTNING_RUNS = {
    "cpu": LightningRun([PYTHON, *_backend("cpu", 1)], 1, "cpu", 1),
    "ddp_spawn": LightningRun([PYTHON, *_backend("ddp_spawn", 2)], 2, "ddp_spawn", 1),
    # Rank 0 is the process started here; cardcage re-runs the script for rank 1.
    "ddp": LightningRun([PYTHON, *_backend("ddp", 2)], 2, "ddp", 2),
    "torchrun": LightningRun(
        [*TORCHRUN, *_backend("ddp", 2)],
        2,
        "ddp",
        2,
    ),
    "fsdp_spawn": LightningRun([PYTHON, *_backend("fsdp_spawn", 2)], 2, "fsdp_spawn", 1),
}


def load_lightning_style() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cardcage_example_lightning_style", LIGHTNING)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def lightning_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Start every selected backend's run of examples/lightning_style.py at once."""
    root = tmp_path_factory.mktemp("lightning_style")
    started = {
        backend: Run.start(f"lightning_style-{backend}", root / backend, run.command)
        for backend, run in LIGHTNING_RUNS.items()
        if backend in selected_params(request, "backend")
    }
    yield started
    for run in started.values():
        run.kill()


@pytest.fixture(scope="module")
def lightning_style() -> ModuleType:
    return load_lightning_style()


def test_lightning_style_reference_is_sensitive(lightning_style: ModuleType) -> None:
    """The reference comparison can tell: accumulation, clipping, the per-rank split and
    early stopping each change the weights the reference ends with."""
    example = lightning_style
    two = example.reference(2, LIGHTNING_BATCH, LIGHTNING_EPOCHS)
    one = example.reference(1, LIGHTNING_BATCH, LIGHTNING_EPOCHS)
    for weights in (
        one["weights"],  # every rank trained on all the data
        example.reference(2, LIGHTNING_BATCH, LIGHTNING_EPOCHS, accumulate=1)["weights"],
        example.reference(2, LIGHTNING_BATCH, LIGHTNING_EPOCHS, clip=0.0)["weights"],
        example.reference(2, LIGHTNING_BATCH, two["epochs"] - 1)["weights"],  # one epoch less
        example.Regressor().state_dict(),
    ):
        assert max_difference(weights, two["weights"]) > 100 * TOLERANCE
    # EarlyStopping ends both before max_epochs, at different epochs
    assert one["epochs"] < two["epochs"] < LIGHTNING_EPOCHS


@pytest.mark.parametrize("backend", sorted(LIGHTNING_RUNS))
def test_lightning_style_example_matches_its_reference(
    backend: str, lightning_runs: dict[str, Run], lightning_style: ModuleType
) -> None:
    """On each backend: the final weights, the number of steps (EarlyStopping stopped every
    rank at the same epoch as the reference's rule) and the best validation loss equal the
    plain loop's; the best checkpoint exists where the caller is told it is; one CSV log,
    written by rank 0 only."""
    run = lightning_runs[backend]
    lines = run.finish()
    expected = LIGHTNING_RUNS[backend]
    output = run.output()
    assert len(lines) == expected.lines, output
    reference = lightning_style.reference(expected.ranks, LIGHTNING_BATCH, LIGHTNING_EPOCHS)
    for line in lines:
        assert line["example"] == "lightning_style"
        assert (line["accelerator"], line["world_size"]) == (expected.accelerator, expected.ranks)
        assert line["global_step"] == reference["global_step"], output
        difference = max_difference(weights_of(line), reference["weights"])
        print(f"{backend} rank {line['rank']}: max |w - reference| = {difference:.3g}")
        assert difference <= TOLERANCE, f"rank {line['rank']} differs by {difference:g}\n{output}"
        assert abs(line["best_model_score"] - reference["best_val_loss"]) <= TOLERANCE
        best = Path(line["best_model_path"])
        assert best.is_file() and best.suffix == ".ckpt", line["best_model_path"]
        assert best.is_relative_to(run.folder.resolve()), best
        # Lightning 1.0's names and counts: the epoch that validated best, the epoch it stopped
        assert best.name.startswith(f"epoch={reference['best_epoch']}-"), best.name
        assert line["stopped_epoch"] == reference["epochs"] - 1, output
        assert {"train_loss_step", "train_loss_epoch", "val_loss", "val_mae"} <= set(
            line["metrics"]
        )
    by_rank = {line["rank"]: line for line in lines}
    assert sorted(by_rank) == list(range(len(lines))), output
    if backend != "torchrun":  # the process started here trains as rank 0, or spawned them
        assert by_rank[0]["pid"] == run.popen.pid
    logs = sorted((run.folder / "lightning_style_runs" / "logs").glob("*/metrics.csv"))
    assert len(logs) == 1, logs  # one logger version: only rank 0 wrote
    header = logs[0].read_text().splitlines()[0].split(",")
    assert {"val_loss", "train_loss_step", "train_loss_epoch"} <= set(header), header


# -- examples/own_loop.py: a hand-written loop driven through cardcage.Cage, with
# no_backward_sync accumulation, clipping, and a checkpoint saved every epoch.

OWN_LOOP = str(EXAMPLES / "own_loop.py")
#: The example's defaults: samples per process per batch, and epochs.
OWN_LOOP_BATCH, OWN_LOOP_EPOCHS = 8, 2


def _own_loop(name: str, processes: int, *more: str) -> list[str]:
    return [
        PYTHON,
        OWN_LOOP,
        "--distributed-backend",
        name,
        "--num-processes",
        str(processes),
        *more,
    ]


#: backend -> (command, processes). The process started here prints the one line (it is
#: rank 0, or it spawned the workers and got rank 0's result back).
OWN_LOOP_RUNS = {
    "cpu": (_own_loop("cpu", 1), 1),
    "ddp_spawn": (_own_loop("ddp_spawn", 2), 2),
}


def load_own_loop() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cardcage_example_own_loop", OWN_LOOP)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def own_loop_reference(
    batch_size: int,
    epochs: int,
    accumulate: int | None = None,
    clip: float | None = None,
) -> tuple[dict[str, torch.Tensor], float]:
    """The example's ``main`` as a plain PyTorch loop in one process, without cardcage:
    the final weights and the final model's mean squared error over the data set."""
    example = load_own_loop()
    accumulate = example.ACCUMULATE if accumulate is None else accumulate
    clip = example.CLIP if clip is None else clip
    model = example.Regressor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(example.dataset(), batch_size=batch_size)
    for _ in range(epochs):
        model.train()
        for index, (x, y) in enumerate(loader):
            loss = torch.nn.functional.mse_loss(model(x), y) / accumulate
            torch.autograd.backward(loss)
            if (index + 1) % accumulate == 0:
                if clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        errors = torch.zeros(2)
        for x, y in torch.utils.data.DataLoader(example.dataset(), batch_size=64):
            errors[0] += torch.nn.functional.mse_loss(model(x), y, reduction="sum").float()
            errors[1] += y.numel()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return weights, float(errors[0] / errors[1])


def saved_checkpoint(path: str) -> dict[str, Any]:
    """The example's checkpoint, read the way its docs say any program can read it."""
    saved: dict[str, Any] = torch.load(path, weights_only=True)
    return saved


@pytest.fixture(scope="module")
def own_loop_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Start every selected backend's run of examples/own_loop.py at once."""
    root = tmp_path_factory.mktemp("own_loop")
    started = {
        backend: Run.start(f"own_loop-{backend}", root / backend, command)
        for backend, (command, _) in OWN_LOOP_RUNS.items()
        if backend in selected_params(request, "own_backend")
    }
    yield started
    for run in started.values():
        run.kill()


def test_own_loop_reference_is_sensitive() -> None:
    """The comparison can tell: the batch size (one process at twice the batch), the
    accumulation and the clipping each change the weights the plain loop ends with."""
    weights, loss = own_loop_reference(OWN_LOOP_BATCH, OWN_LOOP_EPOCHS)
    example = load_own_loop()
    for other in (
        own_loop_reference(2 * OWN_LOOP_BATCH, OWN_LOOP_EPOCHS)[0],
        own_loop_reference(OWN_LOOP_BATCH, OWN_LOOP_EPOCHS, accumulate=1)[0],
        own_loop_reference(OWN_LOOP_BATCH, OWN_LOOP_EPOCHS, clip=0.0)[0],
        own_loop_reference(OWN_LOOP_BATCH, OWN_LOOP_EPOCHS - 1)[0],
        example.Regressor().state_dict(),
    ):
        assert max_difference(other, weights) > 100 * TOLERANCE
    assert loss < own_loop_reference(OWN_LOOP_BATCH, 0)[1]  # training lowered the error


@pytest.mark.parametrize("own_backend", sorted(OWN_LOOP_RUNS))
def test_own_loop_example_matches_the_plain_loop(
    own_backend: str, own_loop_runs: dict[str, Run]
) -> None:
    """cpu: the saved weights and the returned loss equal the plain loop's bit for bit.
    ddp_spawn with 2 processes: within 1e-5 of the plain loop at twice the batch (each step's
    gradient is the mean over both ranks' micro-batches). The checkpoint holds the user's
    own state_dict (no wrapper prefix), loadable with weights_only=True, and the caller
    gets rank 0's return value."""
    run = own_loop_runs[own_backend]
    lines = run.finish()
    output = run.output()
    _, processes = OWN_LOOP_RUNS[own_backend]
    assert len(lines) == 1, output
    (line,) = lines
    assert line["example"] == "own_loop"
    assert (line["accelerator"], line["world_size"]) == (own_backend, processes), output
    assert line["pid"] == run.popen.pid
    saved = saved_checkpoint(line["checkpoint"])
    assert saved["epoch"] == OWN_LOOP_EPOCHS
    assert "optimizer" in saved
    weights, loss = own_loop_reference(processes * OWN_LOOP_BATCH, OWN_LOOP_EPOCHS)
    assert sorted(saved["model"]) == sorted(weights)
    difference = max_difference(saved["model"], weights)
    print(f"own_loop {own_backend}: max |w - plain loop| = {difference:.3g} ({run.seconds:.1f}s)")
    if own_backend == "cpu":
        for key, value in weights.items():
            assert torch.equal(saved["model"][key], value), f"{key} differs\n{output}"
        assert line["loss"] == loss, output
    else:
        assert difference <= TOLERANCE, f"differs by {difference:g}\n{output}"
        assert abs(line["loss"] - loss) <= TOLERANCE, output


def test_own_loop_example_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """A run of one epoch, then a run of two with the same checkpoint file: the second
    trains only the second epoch (from the saved weights and Adam's saved state) and ends
    bit for bit where two uninterrupted epochs of the plain loop end."""
    checkpoint = str(tmp_path / "own_loop.ckpt")
    for epochs in (1, 2):
        run = Run.start(
            f"own_loop-resume-{epochs}",
            tmp_path / f"run{epochs}",
            _own_loop("cpu", 1, "--max-epochs", str(epochs), "--checkpoint", checkpoint),
        )
        (line,) = run.finish()
    stdout = (tmp_path / "run2" / "stdout").read_text()
    assert "resuming at epoch 1" in stdout and "epoch 0:" not in stdout, stdout
    assert "epoch 1:" in stdout, stdout
    weights, loss = own_loop_reference(OWN_LOOP_BATCH, 2)
    saved = saved_checkpoint(checkpoint)
    assert saved["epoch"] == 2
    for key, value in weights.items():
        assert torch.equal(saved["model"][key], value), key
    assert line["loss"] == loss
