"""examples/tpu/train.py, run as a user runs it with ``PJRT_DEVICE=CPU``: one core, and every
core (``--tpu-cores 8``) on two XLA CPU devices (``CPU_NUM_DEVICES=2``), each in a fresh process
(``xmp.spawn`` needs one). The example prints one ``cardcage-example:`` JSON line with the final
weights; they must match the example's ``reference()``, a plain PyTorch loop on the CPU, on
batches as large as all the replicas' batches of a step together (the data is not shuffled).

Skipped, with the reason, where torch_xla is not installed (``nox -s tpu`` installs it).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("torch_xla") is None,
        reason="torch_xla is not installed: run `nox -s tpu` (torch 2.9.0 + torch-xla 2.9.0)",
    ),
    pytest.mark.slow,
]

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tpu" / "train.py"
MARK = "cardcage-example: "
MARKER = "CARDCAGE_TEST_MARKER"
TIMEOUT = 600  # importing torch_xla takes about 25 s on a busy 2-core machine
TOLERANCE = 1e-5  # measured: 2e-7 (one core), 9e-8 (two replicas)
SAMPLES, EPOCHS, BATCH = 256, 2, 8  # the example's defaults
#: Variables that steer XLA, a launcher or cardcage: none of them reaches the example.
STEERING_PREFIXES = ("CARDCAGE_", "PJRT_", "XLA_", "XRT_", "TPU_", "TORCHELASTIC_", "SLURM_")
STEERING = {"CPU_NUM_DEVICES", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"}


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("cardcage_example_tpu", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def marked_processes(marker: str) -> list[int]:
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            state = (Path("/proc", entry, "stat")).read_text().rpartition(")")[2].split()[0]
            if state not in ("Z", "X") and needle in Path("/proc", entry, "environ").read_bytes():
                found.append(int(entry))
        except OSError:
            continue
    return found


def run_example(tmp_path: Path, *args: str, **env: str) -> dict[str, Any]:
    """Run the example in a fresh process; return its report line, once nothing it started
    is left and no temporary folder of cardcage's remains."""
    marker = uuid.uuid4().hex
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    clean = {
        key: value
        for key, value in os.environ.items()
        if key not in STEERING and not key.startswith(STEERING_PREFIXES)
    }
    clean.update({"PJRT_DEVICE": "CPU", MARKER: marker, "TMPDIR": str(tmpdir), **env})
    process = subprocess.Popen(
        [sys.executable, str(EXAMPLE), *args],
        cwd=tmp_path,
        env=clean,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"the example did not end within {TIMEOUT}s\n{stdout}\n{stderr[-6000:]}")
    assert process.returncode == 0, f"{stdout}\n{stderr[-6000:]}"
    deadline = time.monotonic() + 10
    while (left := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {left}"
    assert not list(tmpdir.glob("cardcage-*")), sorted(p.name for p in tmpdir.iterdir())
    lines = [json.loads(line[len(MARK) :]) for line in stdout.splitlines() if line.startswith(MARK)]
    assert len(lines) == 1, f"{stdout}\n{stderr[-6000:]}"  # replicas report nothing
    report: dict[str, Any] = lines[0]
    return report


def max_difference(line: dict[str, Any], reference: dict[str, torch.Tensor]) -> float:
    assert sorted(line["weights"]) == sorted(reference)
    return max(
        float((torch.tensor(value).double() - reference[key].double()).abs().max())
        for key, value in line["weights"].items()
    )


@pytest.mark.parametrize(
    ("tpu_cores", "replicas"), [("1", 1), ("8", 2)], ids=["one-core", "every-core"]
)
def test_the_example_trains_like_a_plain_cpu_loop(
    tmp_path: Path, tpu_cores: str, replicas: int
) -> None:
    line = run_example(tmp_path, "--tpu-cores", tpu_cores, CPU_NUM_DEVICES=str(replicas))
    assert (line["accelerator"], line["rule"]) == ("tpu", "tpu_cores")
    assert line["tpu_cores"] == int(tpu_cores)
    assert line["global_step"] == EPOCHS * SAMPLES // (replicas * BATCH)
    # One core: the model stays on the XLA device. Every core: rank 0's weights, on the CPU.
    assert line["device"] == ("xla:0" if replicas == 1 else "cpu")
    example = load_example()
    reference = example.reference(replicas * BATCH, EPOCHS, SAMPLES)
    other = example.reference(2 * BATCH if replicas == 1 else BATCH, EPOCHS, SAMPLES)
    difference = max_difference(line, reference)
    print(f"tpu_cores={tpu_cores}, {replicas} replica(s): max |w - reference| = {difference:.3g}")
    assert difference < TOLERANCE
    assert max_difference(line, other) > 100 * TOLERANCE  # the batch per step mattered
