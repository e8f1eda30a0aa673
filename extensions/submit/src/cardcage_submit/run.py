"""Inside a job: the grid point it runs (:class:`Run`, :func:`current_run`), and the function
submitit calls in every task (:func:`_run_point`), which takes the signals back from
submitit before the target runs and writes rank 0's result."""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cardcage.sdk import REQUEUED_EXIT_STATUS, Trainer, parse_signal
from cardcage_submit.files import POINT_FILE, RESULT_FILE, _json_safe, _write_json
from cardcage_submit.grid import Value

if TYPE_CHECKING:
    from cardcage_submit.target import GridPoint

#: Inside a job: the path of the grid point's ``hparams.json`` (:func:`current_run`).
RUN_VARIABLE = "CARDCAGE_SUBMIT_RUN"


@dataclass(frozen=True)
class Run:
    """The grid point a job runs (inside the job): see :func:`current_run`."""

    index: int
    count: int
    hparams: dict[str, Value]
    folder: Path
    trainer_flags: dict[str, Any]
    job_id: str | None
    restart: int

    def trainer(self, **overrides: Any) -> Trainer:
        """A :class:`cardcage.Trainer` with the submitted flags, ``default_root_dir`` the
        point's folder (it holds the requeue checkpoint), and ``overrides``."""
        flags = {**self.trainer_flags, "default_root_dir": str(self.folder), **overrides}
        return Trainer(**flags)


def current_run() -> Run | None:
    """Inside a job submitted by cardcage, its grid point; ``None`` elsewhere."""
    path = os.environ.get(RUN_VARIABLE)
    if not path:
        return None
    data = json.loads(Path(path).read_text())
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    return Run(
        index=int(data["index"]),
        count=int(data["count"]),
        hparams=dict(data["hparams"]),
        folder=Path(data["folder"]),
        trainer_flags=dict(data["trainer_flags"]),
        job_id=os.environ.get("SLURM_JOB_ID") or data.get("job_id"),
        restart=int(restart) if restart.isdigit() else 0,
    )


def _take_signals(requeue_signal: str | None) -> None:
    """Undo submitit's signal handlers, so that cardcage's requeue handler alone acts.

    submitit ignores SIGTERM and requeues on its own signal (``USR2``); cardcage's handler
    is installed when ``fit`` starts, for ``requeue_signal``. SIGTERM ends the process again
    (``scancel`` stops every rank at once, as in a plain sbatch job); the requeue signal has
    its default action until ``fit`` installs the handler; submitit's signal, when it is
    not the requeue signal, is ignored (sbatch sends it only without requeue).
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    theirs = parse_signal(os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), "submitit")
    ours = parse_signal(requeue_signal) if requeue_signal else None
    if ours is not None:
        signal.signal(ours, signal.SIG_DFL)
    if theirs is not None and theirs != ours:
        signal.signal(theirs, signal.SIG_IGN)


def _run_point(point: GridPoint) -> Any:
    """Run one grid point in one task of its job (called by submitit in every task)."""
    _take_signals(point.requeue_signal)
    os.environ[RUN_VARIABLE] = str(Path(point.folder) / POINT_FILE)
    target = point.target
    try:
        if target.kind == "script":
            value = _run_script(target.spec, [*map(str, point.args), *_script_options(point)])
        else:
            function = target.load()
            value = function(*point.args, **point.kwargs, **point.hparams)
    except SystemExit as exit_:
        if exit_.code == REQUEUED_EXIT_STATUS:
            raise  # requeued: no result; the job runs again
        if exit_.code not in (None, 0):
            raise RuntimeError(f"{target.spec} exited with status {exit_.code}") from None
        value = None
    if os.environ.get("SLURM_PROCID", "0") == "0":
        record: dict[str, Any] = {
            "index": point.index,
            "hparams": point.hparams,
            "job_id": os.environ.get("SLURM_JOB_ID"),
            "restarts": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        }
        safe = _json_safe(value)
        if safe is not None or value is None:
            record["result"] = safe
        else:
            record["result_type"] = type(value).__name__
            record["note"] = "not JSON: read it with Grid.results() (submitit's result pickle)"
        _write_json(Path(point.folder) / RESULT_FILE, record)
    return value


def _script_options(point: GridPoint) -> list[str]:
    return [f"--{name}={value}" for name, value in point.hparams.items()]


def _run_script(path: str, argv: list[str]) -> Any:
    """Run ``path`` as ``__main__`` in this process, as ``python path argv...`` would."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [path, *argv]
    sys.path.insert(0, str(Path(path).parent))
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return None
