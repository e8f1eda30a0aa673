"""The jobs a test starts with :class:`cardcage.testing.harness.Harness` are runs of their
own, also when the test itself runs inside a fit's process."""

from __future__ import annotations

from pathlib import Path

import pytest

from cardcage.config import variables
from cardcage.testing.harness import MARKER, Harness

#: What cardcage sets for the processes a fit starts: its internal variables (the fit's
#: identity among them), and a restart's checkpoint and the fit's checkpoint folder.
SET_BY_A_FIT = [
    *(name for name in variables.INTERNAL if not name.endswith("*")),
    variables.RESTART_FROM,
    variables.CHECKPOINT_DIR,
]


def test_a_fits_variables_do_not_reach_the_jobs_a_test_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A relaunched rank, or a notebook that runs the kit after a fit, holds what cardcage set
    for that fit. A job that inherited ``CARDCAGE_RUN_ID`` would take the fit's checkpoints
    for its own and resume from them; one that inherited the heartbeat folder or the error
    file would write its progress and its failures into the enclosing job's."""
    assert "CARDCAGE_RUN_ID" in SET_BY_A_FIT
    for name in SET_BY_A_FIT:
        monkeypatch.setenv(name, "set-for-the-enclosing-fit")
    harness = Harness(tmp_path)
    env = harness.env()
    assert [name for name in SET_BY_A_FIT if name in env] == []
    assert env[MARKER] == harness.marker
    # A test that means to set one still can.
    assert harness.env(CARDCAGE_RUN_ID="chosen")["CARDCAGE_RUN_ID"] == "chosen"
