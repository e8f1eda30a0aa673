"""A fit leaves the process that called it as it found it: fits in a row in one process (a
notebook, a sweep, a test file) each train as if alone.

One real process (``scripts/fits_in_a_row.py``) runs an in-process ``fsdp`` fit, a
two-process ``ddp_spawn`` fit, an ``fsdp`` fit whose ``training_step`` raises, and a
``ddp_spawn`` fit again. The in-process fits set rank variables, join a process group and
change torch's thread count and cudnn flag in that process; left there, they made the
spawn fit select a torchelastic job of one process and train alone.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from .conftest import PYTHON, SCRIPTS

pytestmark = pytest.mark.slow

TOLERANCE = 1e-5


def close(weights: list[float], reference: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(weights, reference, strict=True))


@pytest.fixture(scope="module")
def fits(module_harness: Any) -> dict[str, Any]:
    out = module_harness.root / "out"
    module_harness.start([PYTHON, str(SCRIPTS / "fits_in_a_row.py"), str(out)]).check()
    module_harness.assert_no_leftovers()  # no process, no cardcage-* temporary folder
    result: dict[str, Any] = json.loads((out / "fits_in_a_row.json").read_text())
    return result


@pytest.mark.parametrize("after", ["fsdp", "spawn", "failed fsdp", "spawn again"])
def test_after_each_fit_the_process_is_as_before_the_first(fits: Any, after: str) -> None:
    """Environment variables, process group, torch's thread count and cudnn flag, the
    excepthooks, the signal handlers: as they were, whether the fit returned or raised."""
    assert fits["changes"][after] == {}


def test_a_failed_fit_raised_its_own_error(fits: Any) -> None:
    assert "injected failure at step 2 on rank 0" in fits["failure"]


@pytest.mark.parametrize("which", ["spawn", "spawn_again"])
def test_a_spawn_fit_after_an_in_process_fit_trains_two_processes(fits: Any, which: str) -> None:
    """Two processes of batch 8 reproduce one process of batch 16 (a plain PyTorch loop),
    selected as a local job of two, with no warning."""
    spawn = fits[which]
    assert (spawn["cluster"], spawn["world_size"], spawn["warnings"]) == ("local", 2, [])
    assert close(spawn["weights"], fits["reference"]["16"]) <= TOLERANCE


def test_the_in_process_fsdp_fit_trains_as_one_process(fits: Any) -> None:
    assert close(fits["fsdp"], fits["reference"]["8"]) <= TOLERANCE
