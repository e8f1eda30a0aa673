"""The tools outside Python that submitting runs: submitit (imported only when a job is
planned or submitted, never by ``import cardcage``) and SLURM's commands; the error they
raise when they refuse or fail."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from typing import Any

from cardcage.sdk import MisconfigurationError

#: cardcage-submit's requirement on submitit (its pyproject.toml), for messages.
SUBMITIT_REQUIREMENT = "submitit>=1.5.4,<1.6"


class SubmissionError(RuntimeError):
    """sbatch (or another SLURM command) refused or failed; the message says what it said."""


def _submitit() -> Any:
    try:
        import submitit
    except ImportError:
        raise MisconfigurationError(
            "submitting to SLURM needs submitit, which is not installed. Install it with "
            f"`pip install 'cardcage[submit]'` (or `pip install '{SUBMITIT_REQUIREMENT}'`)."
        ) from None
    return submitit


def _slurm(command: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(
            list(command), capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
