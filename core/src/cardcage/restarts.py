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
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cardcage.errors import RankFailedError
from cardcage.rendezvous import HOSTED_STORE

if TYPE_CHECKING:
    from cardcage.launchers import Launcher
    from cardcage.protocol import TrainerProtocol as Trainer

log = logging.getLogger("cardcage")

LAST = "last.ckpt"
#: The folder of step checkpoints when ``default_root_dir`` is None (set by ``fit``).
CHECKPOINT_DIR = "CARDCAGE_CHECKPOINT_DIR"
#: The checkpoint a restarted attempt resumes from (for processes that re-run the script).
RESTART_FROM = "CARDCAGE_RESTART_FROM"
#: Variables by which a cluster says this process is a restart of the job.
RESTART_COUNTS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
#: Steps between step checkpoints when ``max_restarts`` asks for them and nothing else is set.
DEFAULT_EVERY = 100


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
    resumes from ``last.ckpt`` under ``default_root_dir`` when there is one.
    """
    named = getattr(trainer, "restart_from", None) or env.get(RESTART_FROM)
    if named:
        return str(named)
    if any(int(env.get(name) or 0) > 0 for name in RESTART_COUNTS):
        folder = checkpoint_folder(trainer.flags.default_root_dir, {})
        if folder is not None and (folder / LAST).exists():
            return str(folder / LAST)
    return None


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
    made = tempfile.mkdtemp(prefix="cardcage-checkpoints-")
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
    """``CARDCAGE_RESTART_FROM`` as it was before this ``fit``: a restart sets it for the
    processes it starts again, and it must not outlive them (the next Trainer of the script
    would resume from it, or find it gone with the temporary folder)."""
    before = os.environ.get(RESTART_FROM)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(RESTART_FROM, None)
        else:
            os.environ[RESTART_FROM] = before


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
        while True:
            try:
                return launcher.launch(trainer)
            except RankFailedError as error:
                if trainer.restarts >= allowed:
                    if allowed:
                        raise _spent(error, trainer.restarts) from None
                    raise
                trainer.restarts += 1
                launcher.reset()
                sys.excepthook = hook
                _prepare_restart(trainer, folder, initial, error)


def _prepare_restart(
    trainer: Trainer, folder: Path | None, initial: dict[str, Any] | None, error: RankFailedError
) -> None:
    last = folder / LAST if folder is not None else None
    where = "the start"
    _materialize(trainer.model)
    if last is not None and last.exists():
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
        _what(error),
        trainer.restarts,
        trainer.flags.max_restarts,
        where,
    )


def _materialize(model: Any) -> None:
    """Give a model whose tensors a backend moved to ``meta`` (fsdp) storage again."""
    if any(t.is_meta for t in model.state_dict().values()):
        model.to_empty(device="cpu")


def _what(error: RankFailedError) -> str:
    code = error.exitcode
    if code is not None and code < 0:
        return f"was killed by signal {-code}"
    return f"exited with status {code}" if not error.details else "failed"


def _spent(error: RankFailedError, restarts: int) -> RankFailedError:
    reason = f"{_what(error)} after {restarts} restart(s), all that max_restarts={restarts} allows"
    return RankFailedError(error.rank, error.exitcode, error.details, reason)
