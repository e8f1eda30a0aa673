"""The short soak CI keeps: 10 relaunch and 10 spawn launches in a row, half of them beside a
CPU hog, must all exit 0, leave no process and never hang (``benchmarks/soak.py``; the long
form is ``nox -s soak``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from .conftest import PYTHON

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def test_ten_relaunch_and_ten_spawn_launches_all_end_cleanly(tmp_path: Path) -> None:
    report = tmp_path / "soak.json"
    done = subprocess.run(
        [PYTHON, str(SOAK), "--launchers", "relaunch,spawn", "--runs", "10", "--json", str(report)],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert report.exists(), done.stdout + done.stderr
    results = json.loads(report.read_text())
    for launcher in ("relaunch", "spawn"):
        by_load = results[launcher]
        assert sum(s["runs"] for s in by_load.values()) == 10
        assert by_load["quiet"]["runs"] == by_load["hog"]["runs"] == 5
        bad = {load: (s["failures"], s["hangs"]) for load, s in by_load.items()}
        assert all(b == (0, 0) for b in bad.values()), f"{launcher}: {bad}\n{done.stdout}"
    assert done.returncode == 0, done.stdout + done.stderr
