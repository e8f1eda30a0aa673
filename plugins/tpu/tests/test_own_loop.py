"""A user's own loop on every core through ``cardcage.Cage(tpu_cores=8)`` on XLA's CPU device
(own_loop_job.py in a fresh process: two replicas, threads of the process ``xmp.spawn``
starts). Proven: 2 replicas of batch 8 train like one CPU process of batch 16 with momentum
SGD, though each replica builds its model from a seed of its own (setup gives every replica
rank 0's weights); accumulation over two backward passes, inside ``no_backward_sync`` or
not; two modules each with its optimizer; ``clip_gradients``'s norm read at once and the
weights read after each step (no replica left waiting in an all-reduce); ``save`` writes a
CPU file that ``torch.load(weights_only=True)`` reads and ``load`` resumes Adam from it;
``all_gather`` and ``all_reduce``.

Skipped, with the reason, where torch_xla is not installed (``nox -s tpu`` installs it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("torch_xla") is None,
        reason="torch_xla is not installed: run `nox -s tpu` (torch 2.9.0 + torch-xla 2.9.0)",
    ),
    pytest.mark.slow,
]

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from own_loop_job import SCENARIOS  # noqa: E402

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("own-loop")
    env = {
        **os.environ,
        "PJRT_DEVICE": "CPU",
        "CPU_NUM_DEVICES": "2",
        "CARDCAGE_PLUGINS_AUTOLOAD": "0",
        "CARDCAGE_PLUGINS": "tpu",
    }
    env.pop("PJRT_CPU_ASYNC_CLIENT", None)
    command = [sys.executable, str(HERE / "own_loop_job.py"), str(out)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    return {
        name: json.loads((out / f"{name}.json").read_text())
        for name in ("returned", "plain", "checkpoint")
    }


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_two_replicas_of_batch_8_train_like_one_process_of_batch_16(
    job: dict[str, Any], scenario: str
) -> None:
    got, want = job["returned"][scenario], job["plain"][scenario]
    pairs = zip(got, want, strict=True)
    difference = max(abs(a - b) for g, w in pairs for a, b in zip(g, w, strict=True))
    assert difference < TOLERANCE, f"{scenario}: rank 0's weights differ by {difference}"


def test_save_writes_cpu_tensors_and_load_returns_the_other_entries(job: dict[str, Any]) -> None:
    saved = job["checkpoint"]
    assert saved["devices"] == ["cpu"]
    assert saved["model"] == ["0.bias", "0.weight", "2.bias", "2.weight"]  # no wrapper prefix
    assert saved["optimizer"] == ["param_groups", "state"]
    assert job["returned"]["rest"] == {"epoch": 1}


def test_the_collectives_meet_every_replica(job: dict[str, Any]) -> None:
    assert job["returned"]["world_size"] == 2
    assert job["returned"]["gathered"] == [[1.0, 10.0], [2.0, 20.0]]
    assert job["returned"]["reduced"] == [1.5]
