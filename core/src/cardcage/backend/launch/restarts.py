"""Restarts: with ``max_restarts=N`` a dead rank costs one restart, not the run.

The launcher that owns every process of the job (spawn's workers, the script relaunch's
children with this process as rank 0) has already stopped every rank and raised
:class:`~cardcage.errors.RankFailedError` when one died. :func:`launch` then starts the
processes again, up to ``max_restarts`` times, each time resuming from the last step
checkpoint (``checkpoint_every_n_steps``), or from the start when none was written yet.

Step checkpoints are one file, ``last.ckpt``, under ``default_root_dir`` (or a temporary
folder that ``fit`` removes when it returns), written atomically every n optimizer steps:
a crash mid-write leaves the previous one whole. A process that a cluster restarted (torchrun
``--max-restarts``, a SLURM job requeued with ``--requeue``) finds it there by itself.

Every checkpoint records the run that wrote it (:class:`Run`: the ``fit``, and the cluster
job around it), decided once when ``fit`` starts (:func:`this_run`). A restart resumes only
from a checkpoint of its own run: ``max_restarts`` from one of this ``fit``, torchrun's and
SLURM's restarts from one of this job. Another run's ``last.ckpt`` in ``default_root_dir``
is never loaded implicitly; ``fit`` warns once that it is there.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import shutil
import socket
import sys
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cardcage.backend.launch import tempdirs
from cardcage.backend.launch.rendezvous import HOSTED_STORE
from cardcage.checkpoints import io as checkpoint
from cardcage.checkpoints.io import Run
from cardcage.errors import RankFailedError

if TYPE_CHECKING:
    from cardcage.backend.launch.launcher import Launcher
    from cardcage.backend.trainer_protocol import TrainerProtocol as Trainer

log = logging.getLogger("cardcage")

LAST = "last.ckpt"
#: The folder of step checkpoints when ``default_root_dir`` is None (set by ``fit``).
CHECKPOINT_DIR = "CARDCAGE_CHECKPOINT_DIR"
#: The checkpoint a restarted attempt resumes from (for processes that re-run the script).
RESTART_FROM = "CARDCAGE_RESTART_FROM"
#: How many restarts the processes a restart starts are on (for a Cage's ``restarts``).
RESTARTS = "CARDCAGE_RESTARTS"
#: Variables by which a cluster says this process is a restart of the job.
RESTART_COUNTS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
#: The ``fit`` a started process belongs to (set by ``fit`` for the processes it starts).
RUN_ID = "CARDCAGE_RUN_ID"
#: The folder of the requeue checkpoint (cardcage.train.requeue; that layer is above this one).
REQUEUE_DIR = "CARDCAGE_REQUEUE_DIR"
#: The folder ``fit`` makes for step checkpoints (the weights) without ``default_root_dir``:
#: + <pid>.<start>@<host>-<random> (cardcage.backend.launch.tempdirs).
FOLDER_PREFIX = "cardcage-checkpoints-"
#: Steps between step checkpoints when ``max_restarts`` asks for them and nothing else is set.
DEFAULT_EVERY = 100


def cluster_job(env: Mapping[str, str]) -> str | None:
    """The job a cluster restarts as a whole, the same in each of its attempts; None outside
    one.

    A SLURM job across its requeues: ``SLURM_JOB_ID`` (with the array task). A torchrun job
    across its restarts: its rendezvous id (``TORCHELASTIC_RUN_ID``: ``--rdzv-id``, a fresh
    uuid with ``--standalone`` or on one node without ``--master-port``, else ``none``), and
    on one node the agent that restarts the workers (their parent process), which tells
    apart two jobs started with the same ``--rdzv-id``.
    """
    slurm = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if slurm:
        array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
        return f"SLURM job {slurm}" + (f" (array {array}_{task})" if array and task else "")
    rdzv = env.get("TORCHELASTIC_RUN_ID")
    if rdzv is None:
        return None
    if env.get("GROUP_WORLD_SIZE", "1") == "1":
        return f"torchrun job {rdzv} (agent {os.getppid()} on {socket.gethostname()})"
    if rdzv in ("", "none"):
        master = f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
        return f"torchrun job none at {master} (no --rdzv-id)"
    return f"torchrun job {rdzv}"


def _whose(record: dict[str, Any] | str) -> str:
    if isinstance(record, str):
        return record
    job = f"{record.get('job')}, " if record.get("job") else ""
    return f"{job}fit {record.get('fit')}"


def restart_count(env: Mapping[str, str]) -> int:
    """How many times a cluster restarted this job (torchrun's or SLURM's count), 0 if none."""
    counts = [env.get(name) or "0" for name in RESTART_COUNTS]
    return max((int(c) for c in counts if c.strip().isdigit()), default=0)


def _top_process(env: Mapping[str, str]) -> bool:
    """This process speaks for the job: not a relaunched child, not a rank other than 0."""
    return env.get(HOSTED_STORE) != "1" and env.get("RANK", "0") in ("", "0")


@contextlib.contextmanager
def this_run(trainer: Trainer) -> Iterator[Run]:
    """One ``fit``'s run: decided here, in the process that called ``fit``, before any
    process starts, and undone when it ends.

    Sets ``trainer.run`` (spawned workers get it with the Trainer) and ``CARDCAGE_RUN_ID``
    (relaunched scripts, whose own ``fit`` takes it); clears the partial files that crashed
    writers left in the checkpoint folders; and, when ``default_root_dir`` holds a
    ``last.ckpt``, decides whether a cluster's restart resumes from it (only from one of
    this job) or warns, once, that it is another run's and is not used.
    """
    env = os.environ
    inherited = env.get(RUN_ID)
    run = Run(inherited or uuid.uuid4().hex, cluster_job(env))
    folder = checkpoint_folder(trainer.flags.default_root_dir, {})
    for place in (folder, env.get(REQUEUE_DIR)):
        if place:
            checkpoint.clear_partial_files(place)
    last = folder / LAST if folder is not None else None
    restarted = restart_count(env) > 0
    wanted = restarted or bool(steps_between_checkpoints(trainer.flags))
    if last is not None and wanted and os.path.exists(last):
        record = checkpoint.recorded_run(last)
        ours = run.job is not None and isinstance(record, dict) and record.get("job") == run.job
        if restarted and ours:
            run = dataclasses.replace(run, resume=str(last))
        elif _top_process(env):
            log.warning(
                "cardcage: %s was written by another run (%s); this run does not resume "
                "from it: a restart resumes only from a checkpoint of its own run.%s To "
                "continue from it, pass resume_from_checkpoint=%r.",
                last,
                _whose(record),
                " This run's first step checkpoint replaces it."
                if steps_between_checkpoints(trainer.flags)
                else "",
                str(last),
            )
    trainer.run = run  # what its checkpoints record; it stays with the Trainer after fit
    if inherited is None:
        os.environ[RUN_ID] = run.fit
    try:
        yield run
    finally:
        if inherited is None:
            os.environ.pop(RUN_ID, None)


def steps_between_checkpoints(flags: Any) -> int:
    """``checkpoint_every_n_steps``, else every 100 steps with ``max_restarts``, else 0."""
    every: int = flags.checkpoint_every_n_steps or (DEFAULT_EVERY if flags.max_restarts else 0)
    return every


def checkpoint_folder(default_root_dir: str | None, env: Mapping[str, str]) -> Path | None:
    """Where step checkpoints go: ``default_root_dir``, else the folder ``fit`` made."""
    folder = default_root_dir or env.get(CHECKPOINT_DIR)
    return Path(folder) if folder else None


def resume_path(trainer: Trainer, env: Mapping[str, str]) -> str | None:
    """The checkpoint a restarted process resumes from, or None for a first start.

    A restart by :func:`launch` names it; a process that torchrun or SLURM started again
    resumes from ``last.ckpt`` under ``default_root_dir`` when its job wrote it (decided
    when ``fit`` started: :func:`this_run`).
    """
    named = getattr(trainer, "restart_from", None) or env.get(RESTART_FROM)
    if named:
        return str(named)
    return trainer.run.resume if trainer.run is not None else None


def save_step(trainer: Trainer) -> None:
    """``checkpoint_every_n_steps``: ``last.ckpt``, on every rank, after a whole step."""
    folder = checkpoint_folder(trainer.flags.default_root_dir, os.environ)
    if folder is None:
        return
    in_epoch, trainer.in_epoch = trainer.in_epoch, False  # a resume draws the next batch
    try:
        trainer.save_checkpoint(folder / LAST)
    finally:
        trainer.in_epoch = in_epoch


@contextlib.contextmanager
def _folder_for(trainer: Trainer) -> Iterator[Path | None]:
    """The step checkpoints' folder for one ``fit``: made and removed here when needed."""
    wanted = steps_between_checkpoints(trainer.flags)
    if trainer.flags.default_root_dir or not wanted or os.environ.get(CHECKPOINT_DIR):
        yield checkpoint_folder(trainer.flags.default_root_dir, os.environ)
        return
    made = str(tempdirs.make(FOLDER_PREFIX))  # private; a SIGKILLed launcher's are removed
    previous = os.environ.get(CHECKPOINT_DIR)
    os.environ[CHECKPOINT_DIR] = made  # spawned and relaunched processes inherit it
    try:
        yield Path(made)
    finally:
        shutil.rmtree(made, ignore_errors=True)
        if previous is None:
            os.environ.pop(CHECKPOINT_DIR, None)
        else:
            os.environ[CHECKPOINT_DIR] = previous


@contextlib.contextmanager
def _restart_from_restored() -> Iterator[None]:
    """``CARDCAGE_RESTART_FROM`` and ``CARDCAGE_RESTARTS`` as they were before this ``fit``:
    a restart sets them for the processes it starts again, and they must not outlive them
    (the next Trainer of the script would resume from it, or find it gone with the
    temporary folder)."""
    before = {name: os.environ.get(name) for name in (RESTART_FROM, RESTARTS)}
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def launch(launcher: Launcher, trainer: Trainer) -> Any:
    """``launcher.launch(trainer)``, started again after a rank's death while restarts last."""
    allowed = trainer.flags.max_restarts
    relaunched = os.environ.get(HOSTED_STORE) == "1"  # a child: its launcher restarts it
    if allowed and not launcher.restartable and not relaunched:
        log.warning(
            "cardcage: max_restarts=%d is ignored: this job's processes were not started by "
            "cardcage (restart them with their launcher, e.g. torchrun --max-restarts; a "
            "restarted process resumes from default_root_dir/%s by itself)",
            allowed,
            LAST,
        )
    if not launcher.restartable:
        allowed = 0
    with _folder_for(trainer) as folder, _restart_from_restored():
        # A rank that trains in this process changes the model in place: keep its start.
        initial = copy.deepcopy(trainer.model.state_dict()) if allowed else None
        hook = sys.excepthook  # torch wraps it at every init_process_group
        try:
            while True:
                try:
                    return launcher.launch(trainer)
                except RankFailedError as error:
                    if trainer.restarts >= allowed:
                        if allowed:
                            raise _spent(error, trainer.restarts) from None
                        raise
                    trainer.restarts += 1
                    os.environ[RESTARTS] = str(trainer.restarts)  # relaunched processes
                    launcher.reset()
                    sys.excepthook = hook
                    if folder is not None:  # what a rank killed mid-write left
                        checkpoint.clear_partial_files(folder)
                    _prepare_restart(trainer, folder, initial, error)
        finally:
            # The ranks are stopped (or done): a writer killed mid-write left its partial file.
            if folder is not None:
                checkpoint.clear_partial_files(folder)


def _prepare_restart(
    trainer: Trainer, folder: Path | None, initial: dict[str, Any] | None, error: RankFailedError
) -> None:
    last = folder / LAST if folder is not None else None
    where = "the start"
    _materialize(trainer.model)
    if last is not None and last.exists() and _written_by_this_fit(trainer, last):
        trainer.restart_from = str(last)
        os.environ[RESTART_FROM] = str(last)
        where = str(last)
    else:
        trainer.restart_from = None
        os.environ.pop(RESTART_FROM, None)
        if initial is not None:
            trainer.model.load_state_dict(initial)
        trainer.current_epoch = trainer.global_step = trainer.batch_idx = 0
    log.warning(
        "cardcage: rank %d %s; restart %d of max_restarts=%d, from %s",
        error.rank,
        error.what,  # its exit status, or what happened when that does not say (it left)
        trainer.restarts,
        trainer.flags.max_restarts,
        where,
    )


def _written_by_this_fit(trainer: Trainer, last: Path) -> bool:
    """Whether ``last`` is this ``fit``'s step checkpoint (another run's is never resumed:
    ``fit`` warned about it when it started)."""
    record = checkpoint.recorded_run(last)
    run = trainer.run
    return run is not None and isinstance(record, dict) and record.get("fit") == run.fit


def _materialize(model: Any) -> None:
    """Give a model whose tensors a backend moved to ``meta`` (fsdp) storage again."""
    if any(t.is_meta for t in model.state_dict().values()):
        model.to_empty(device="cpu")


def _spent(error: RankFailedError, restarts: int) -> RankFailedError:
    reason = f"{error.what} after {restarts} restart(s), all that max_restarts={restarts} allows"
    return RankFailedError(error.rank, error.exitcode, error.details, reason, error.stopped)
