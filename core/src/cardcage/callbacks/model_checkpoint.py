"""``ModelCheckpoint``: save the model at the end of training epochs, keeping the best k.

Every rank calls ``trainer.save_checkpoint`` (a collective: a sharded backend gathers the
state) with the same paths, so the decision what to save and what to delete is taken on
global rank 0 alone and broadcast: a metric logged without ``sync_dist`` differs per rank,
and ranks that decided on their own would diverge (and hang in the collective).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from cardcage.callbacks.base import Callback, missing_metric, validation_is_between
from cardcage.errors import MisconfigurationError

MODES = ("min", "max")
#: A ``{name}`` or ``{name:format_spec}`` field of a filename template.
FIELD = re.compile(r"\{([^{}:]+)(?::([^{}]*))?\}")


class ModelCheckpoint(Callback):
    """Save a checkpoint at the end of every ``every_n_epochs``-th training epoch
    (``on_epoch_end``: after its validation, and after the other callbacks' epoch end).

    - ``dirpath``: where the files go. None: ``<logger.log_dir>/checkpoints`` when the
      trainer has a logger with a ``log_dir``, else ``<default_root_dir>/checkpoints``, else
      ``<cwd>/checkpoints``; decided at the first save, on rank 0, for every rank.
    - ``filename``: a template; ``{epoch}``, ``{step}`` and ``{metric}`` (any key of
      ``trainer.callback_metrics``, with an optional format spec: ``{val_loss:.2f}``) become
      ``name=value`` (``"{epoch}-{val_loss:.2f}"`` gives ``epoch=3-val_loss=0.12.ckpt``);
      write ``name={name}`` to spell it yourself. Default: ``epoch=<e>-step=<s>``. A name
      that is taken gets ``-v0``, ``-v1``, ... before ``.ckpt``.
    - ``monitor``: a metric to rank checkpoints by, best first by ``mode`` (``"min"`` or
      ``"max"``); ``save_top_k`` of them are kept (-1: all; 0: none). Without a monitor each
      save replaces the previous one (``save_top_k=-1`` keeps them all).
    - ``save_last``: also write ``last.ckpt`` each time.

    After ``fit`` (in the caller too): ``best_model_path``, ``best_model_score`` (a tensor;
    None before a monitored save), ``best_k_models`` (path -> score),
    ``kth_best_model_path`` (the worst kept) and ``last_model_path``.
    """

    CHECKPOINT_NAME_LAST = "last"
    FILE_EXTENSION = ".ckpt"
    DEFAULT_FILENAME = "{epoch}-{step}"

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int = 1,
        save_last: bool = False,
        every_n_epochs: int = 1,
    ):
        _check_arguments(dirpath, filename, monitor, mode, save_top_k, save_last, every_n_epochs)
        self._given_dirpath = os.path.realpath(dirpath) if dirpath is not None else None
        self.dirpath: str | None = self._given_dirpath
        self.filename = filename
        self.monitor = monitor
        self.mode = mode
        self.save_top_k = save_top_k
        self.save_last = save_last
        self.every_n_epochs = every_n_epochs

        self.best_model_path = ""
        self.best_model_score: torch.Tensor | None = None
        self.best_k_models: dict[str, torch.Tensor] = {}
        self.kth_best_model_path = ""
        self.last_model_path = ""
        self._last_global_step_saved: int | None = None
        self._warned_missing: set[str] = set()

    # -- the hook -------------------------------------------------------------------------

    def on_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Save (or not) on every rank alike, as rank 0 decided.

        ``on_epoch_end`` comes after every callback's and the model's ``on_train_epoch_end``
        (where EarlyStopping counts), so the checkpoint holds their state after this epoch,
        whatever the order of ``trainer.callbacks``; this epoch's validation metrics are in
        ``trainer.callback_metrics`` already.
        """
        if not self._due(trainer):
            return
        plan = self._plan(trainer) if trainer.is_global_zero else None
        plan = trainer.accelerator.broadcast(plan, 0)
        assert isinstance(plan, dict), "the accelerator's broadcast returned no plan"
        if plan["error"] is not None:
            raise MisconfigurationError(plan["error"])
        self._apply(plan["state"])
        self._last_global_step_saved = int(trainer.global_step)
        for path in plan["save"]:
            trainer.save_checkpoint(path)
        if trainer.is_global_zero:
            for path in plan["delete"]:
                _remove(path)

    def _due(self, trainer: Any) -> bool:
        """Whether this epoch end saves anything: the same answer on every rank."""
        epoch = int(trainer.current_epoch)
        return not (
            trainer.sanity_checking
            or trainer.flags.fast_dev_run
            or (epoch + 1) % self.every_n_epochs != 0
            or (self.save_top_k == 0 and not self.save_last)
            # nothing trained since the last save (an epoch of no batches)
            or self._last_global_step_saved == int(trainer.global_step)
        )

    # -- the decision (rank 0) ------------------------------------------------------------

    def _plan(self, trainer: Any) -> dict[str, Any]:
        """What to save and delete, and the bookkeeping after it; or the error to raise."""
        dirpath = self.dirpath or default_dirpath(trainer)
        metrics = trainer.callback_metrics
        epoch, step = int(trainer.current_epoch), int(trainer.global_step)
        # Plain values only: the plan crosses processes by every backend's broadcast.
        state = self._state()
        state["dirpath"] = dirpath
        score = state["best_model_score"]
        state["best_model_score"] = None if score is None else float(score)
        best_k = {path: float(value) for path, value in self.best_k_models.items()}
        save: list[str] = []
        delete: list[str] = []

        if self.save_top_k != 0 and self.monitor is None:
            path = self._free_path(dirpath, epoch, step, metrics, best_k)
            save.append(path)
            previous = state["best_model_path"]
            if self.save_top_k == 1 and previous and previous != path:
                delete.append(previous)
            state["best_model_path"] = path
        elif self.save_top_k != 0 and self.monitor is not None:
            if self.monitor not in metrics:
                if not validation_is_between(trainer):
                    message = missing_metric(type(self).__name__, self.monitor, metrics)
                    return {"error": message, "state": {}, "save": [], "delete": []}
            elif not validation_is_between(trainer):
                current = self._score(metrics[self.monitor])
                if self._accepts(current, best_k):
                    path = self._free_path(dirpath, epoch, step, metrics, best_k)
                    save.append(path)
                    best_k[path] = current
                    if self.save_top_k != -1 and len(best_k) > self.save_top_k:
                        worst = self._worst(best_k)
                        del best_k[worst]
                        delete.append(worst)
            state["best_k_models"] = best_k
            if best_k:
                best = self._best(best_k)
                state["best_model_path"] = best
                state["best_model_score"] = best_k[best]
                state["kth_best_model_path"] = self._worst(best_k)

        if self.save_last:
            last = os.path.join(dirpath, self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION)
            save.append(last)
            state["last_model_path"] = last

        kept = set(save) | set(best_k) | {state["best_model_path"], state["last_model_path"]}
        delete = [path for path in delete if path not in kept]
        return {"error": None, "state": state, "save": save, "delete": delete}

    def _score(self, value: Any) -> float:
        """The monitored value; NaN ranks worst (Lightning's +-inf)."""
        current = float(value)
        if math.isnan(current):
            current = math.inf if self.mode == "min" else -math.inf
        return current

    def _better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b

    def _accepts(self, current: float, best_k: Mapping[str, float]) -> bool:
        if self.save_top_k == -1 or len(best_k) < self.save_top_k:
            return True
        return self._better(current, best_k[self._worst(best_k)])

    def _best(self, best_k: Mapping[str, float]) -> str:
        pick = min if self.mode == "min" else max
        return pick(best_k, key=best_k.__getitem__)  # ties: the first kept

    def _worst(self, best_k: Mapping[str, float]) -> str:
        pick = max if self.mode == "min" else min
        return pick(best_k, key=best_k.__getitem__)  # ties: the first kept

    def _free_path(
        self,
        dirpath: str,
        epoch: int,
        step: int,
        metrics: Mapping[str, Any],
        taken: Mapping[str, Any],
    ) -> str:
        """The checkpoint's path: the formatted name, versioned when a file or a kept
        checkpoint already has it (a file from an earlier run is never overwritten)."""
        path = self.format_checkpoint_name(epoch, step, metrics, dirpath=dirpath)
        version = 0
        while os.path.exists(path) or path in taken:
            path = self.format_checkpoint_name(epoch, step, metrics, version, dirpath=dirpath)
            version += 1
        return path

    def format_checkpoint_name(
        self,
        epoch: int,
        step: int,
        metrics: Mapping[str, Any],
        ver: int | None = None,
        dirpath: str | None = None,
    ) -> str:
        """The checkpoint path the template gives (``dirpath`` defaults to
        ``self.dirpath``; without either, the bare file name).

        >>> ModelCheckpoint(filename="{epoch}-{val_loss:.2f}").format_checkpoint_name(
        ...     3, 40, {"val_loss": 0.1234})
        'epoch=3-val_loss=0.12.ckpt'
        """
        values: dict[str, Any] = {key: value for key, value in metrics.items()}
        values["epoch"] = epoch
        values["step"] = step

        def field(match: re.Match[str]) -> str:
            name, spec = match[1], match[2] or ""
            before = match.string[: match.start()]
            value = values.get(name)
            if value is None:
                if name not in self._warned_missing:
                    self._warned_missing.add(name)
                    available = ", ".join(sorted(metrics)) or "none"
                    warnings.warn(
                        f"ModelCheckpoint(filename={self.filename!r}): {name!r} is not in"
                        f" trainer.callback_metrics (available: {available}); the name has"
                        " 0 in its place.",
                        stacklevel=2,
                    )
                value = 0
            elif isinstance(value, torch.Tensor):
                value = value.item()
            text = format(value, spec)
            return text if before.endswith(f"{name}=") else f"{name}={text}"

        name = FIELD.sub(field, self.filename or self.DEFAULT_FILENAME)
        if ver is not None:
            name = f"{name}-v{ver}"
        name += self.FILE_EXTENSION
        folder = dirpath if dirpath is not None else self.dirpath
        return os.path.join(folder, name) if folder else name

    # -- state ----------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        return {
            "monitor": self.monitor,
            "dirpath": self.dirpath,
            "best_model_path": self.best_model_path,
            "best_model_score": self.best_model_score,
            "best_k_models": dict(self.best_k_models),
            "kth_best_model_path": self.kth_best_model_path,
            "last_model_path": self.last_model_path,
        }

    def _apply(self, state: Mapping[str, Any]) -> None:
        """Adopt a plan's bookkeeping: its scores are floats, kept as tensors like
        Lightning's (float64: a score read back compares equal to the value it came from)."""
        score = state["best_model_score"]
        self.dirpath = state["dirpath"]
        self.best_model_path = state["best_model_path"]
        self.best_model_score = None if score is None else _tensor(score)
        self.best_k_models = {path: _tensor(v) for path, v in state["best_k_models"].items()}
        self.kth_best_model_path = state["kth_best_model_path"]
        self.last_model_path = state["last_model_path"]

    def on_save_checkpoint(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        return self._state()

    def on_load_checkpoint(self, state: dict[str, Any]) -> None:
        """Continue the saved run's bookkeeping: its top k compete with this run's saves
        (and the worst of them is deleted when a better one comes), unless this callback
        ranks another metric or saves to another folder than the one saved."""
        saved_dirpath = state.get("dirpath")
        if state.get("monitor") != self.monitor:
            warnings.warn(
                f"ModelCheckpoint(monitor={self.monitor!r}) resumes a run that monitored"
                f" {state.get('monitor')!r}: its saved best checkpoints are not ranked by this"
                " metric, so the top k start afresh.",
                stacklevel=2,
            )
            self.last_model_path = state.get("last_model_path", "")
            return
        if self._given_dirpath is not None and saved_dirpath not in (None, self._given_dirpath):
            warnings.warn(
                f"ModelCheckpoint(dirpath={self._given_dirpath!r}) resumes a run that saved to"
                f" {saved_dirpath!r}: best_model_path and best_model_score come back, but the"
                " top k start afresh in the new folder (the old files are left alone).",
                stacklevel=2,
            )
            self.best_model_path = state.get("best_model_path", "")
            self.best_model_score = state.get("best_model_score")
            return
        if saved_dirpath is not None:
            self.dirpath = saved_dirpath
        self.best_model_path = state.get("best_model_path", "")
        self.best_model_score = state.get("best_model_score")
        self.best_k_models = dict(state.get("best_k_models", {}))
        self.kth_best_model_path = state.get("kth_best_model_path", "")
        self.last_model_path = state.get("last_model_path", "")


def _tensor(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64)


def default_dirpath(trainer: Any) -> str:
    """``<logger.log_dir>/checkpoints``, else ``<default_root_dir>/checkpoints``, else
    ``<cwd>/checkpoints``, as an absolute path."""
    logger = trainer.logger
    log_dir = getattr(logger, "log_dir", None) if logger is not None else None
    base = log_dir or trainer.default_root_dir or os.getcwd()
    return os.path.realpath(os.path.join(os.fspath(base), "checkpoints"))


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):  # already gone: nothing to do
        os.remove(path)


def _check_arguments(
    dirpath: Any,
    filename: Any,
    monitor: Any,
    mode: Any,
    save_top_k: Any,
    save_last: Any,
    every_n_epochs: Any,
) -> None:
    def refuse(argument: str, value: Any, fix: str) -> MisconfigurationError:
        return MisconfigurationError(f"ModelCheckpoint({argument}={value!r}): {fix}")

    if dirpath is not None and not isinstance(dirpath, str | os.PathLike):
        raise refuse("dirpath", dirpath, "give a folder path (str or os.PathLike), or None.")
    if filename is not None and not isinstance(filename, str):
        raise refuse("filename", filename, "give a template such as '{epoch}-{val_loss:.2f}'.")
    if filename is not None and filename.endswith(ModelCheckpoint.FILE_EXTENSION):
        raise refuse(
            "filename", filename, "leave out '.ckpt': it is added (give the name's template)."
        )
    if monitor is not None and not isinstance(monitor, str):
        raise refuse("monitor", monitor, "give the name of a logged metric, or None.")
    if mode not in MODES:
        raise refuse(
            "mode",
            mode,
            "mode is 'min' (lower is better, a loss) or 'max' (higher is better, an accuracy);"
            " Lightning's 'auto' is not supported.",
        )
    if not isinstance(save_top_k, int) or isinstance(save_top_k, bool) or save_top_k < -1:
        raise refuse(
            "save_top_k",
            save_top_k,
            "give an int: how many best checkpoints to keep, -1 for all, 0 for none.",
        )
    if monitor is None and save_top_k > 1:
        raise refuse(
            "save_top_k",
            save_top_k,
            f"keeping the best {save_top_k} needs a metric to rank them: set"
            " monitor='<a logged metric>', or save_top_k=-1 to keep every checkpoint.",
        )
    if not isinstance(save_last, bool):
        raise refuse("save_last", save_last, "give True or False.")
    if (
        not isinstance(every_n_epochs, int)
        or isinstance(every_n_epochs, bool)
        or every_n_epochs < 1
    ):
        raise refuse(
            "every_n_epochs",
            every_n_epochs,
            "give an int >= 1: save at the end of every n-th training epoch.",
        )
