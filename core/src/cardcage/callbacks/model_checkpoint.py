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
from cardcage.config import owners
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
        save_weights_only: bool = False,
    ):
        _check_arguments(dirpath, filename, monitor, mode, save_top_k, save_last, every_n_epochs)
        if save_weights_only is not False:
            raise MisconfigurationError(
                f"ModelCheckpoint(save_weights_only={save_weights_only!r}) is not supported: a"
                " checkpoint holds the whole training state, so that fit can resume from it."
                " Fix: leave save_weights_only out; the weights alone are the file's"
                " 'state_dict' (torch.load(best_model_path, weights_only=True)['state_dict'])."
            )
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
        self._trainer: Any = None  # the Trainer this callback was given to (on_init_start)
        self._resumed: dict[str, Any] | None = None  # a loaded state not yet placed
        self._claims: list[str] = []  # rank 0: the names claimed for the saves planned

    def on_init_start(self, trainer: Any) -> None:
        self._trainer = trainer  # where a loaded state is placed (this run's folder)

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
        try:
            plan = self._plan(trainer) if trainer.is_global_zero else None
            plan = trainer.accelerator.broadcast(plan, 0)
            assert isinstance(plan, dict), "the accelerator's broadcast returned no plan"
            if plan["error"] is not None:
                raise MisconfigurationError(plan["error"])
            self._apply(plan["state"])
            self._last_global_step_saved = int(trainer.global_step)
            for path in plan["save"]:
                trainer.save_checkpoint(path)
        finally:
            while self._claims:  # the files are written (or failed): the names are theirs
                _remove(self._claims.pop())
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
        if self._resumed is not None:
            self._place(dirpath)
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
        """The checkpoint's path: the formatted name, versioned when a file, a kept
        checkpoint or another writer's claim already has it (a file from an earlier run is
        never overwritten, nor one that a run beside this one is writing)."""
        path = self.format_checkpoint_name(epoch, step, metrics, dirpath=dirpath)
        version = 0
        while path in taken or not self._claim(path):
            path = self.format_checkpoint_name(epoch, step, metrics, version, dirpath=dirpath)
            version += 1
        return path

    def _claim(self, path: str) -> bool:
        """Claim the name ``path`` until its file is written: ``O_EXCL`` creation of a
        marker beside it (``.<name>.claim``, holding its writer), which one process only
        can make. False when the file exists or another live writer holds the name. A
        marker whose writer has ended is taken over; one that cannot be made (a read-only
        or full disk) claims nothing, and the save names the failure."""
        marker = claim_marker(path)
        for _ in range(2):
            if os.path.lexists(path):
                return False
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                handle = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW)
            except FileExistsError:
                if not _abandoned(marker):
                    return False
                _remove(marker)
                continue
            except OSError:
                return True
            try:
                os.write(handle, owners.owner().encode())
            except OSError:
                pass  # an empty marker still holds the name
            finally:
                os.close(handle)
            self._claims.append(marker)
            if os.path.lexists(path):  # written between the check and the claim
                _remove(self._claims.pop())
                return False
            return True
        return False

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
        """The bookkeeping, each path relative to ``dirpath`` (only files inside it): a
        run that loads the state places the names in its own folder."""
        state = self._state()
        dirpath = state["dirpath"]
        for key in ("best_model_path", "kth_best_model_path", "last_model_path"):
            state[key] = _inside(state[key], dirpath) or ""
        best_k = {_inside(path, dirpath): score for path, score in self.best_k_models.items()}
        state["best_k_models"] = {name: score for name, score in best_k.items() if name}
        return state

    def on_load_checkpoint(self, state: dict[str, Any]) -> None:
        """Continue the saved run's bookkeeping, in this run's own folder: its top k
        compete with this run's saves (and the worst of them is deleted when a better one
        comes) when this callback ranks the same metric. Only the names of files inside the
        saved ``dirpath`` are kept, relative to it, and placed in this run's folder (its
        ``dirpath``, or the default one of the Trainer it belongs to): a name whose file is
        not there is dropped. The state never decides where files go, and never names a
        file outside this run's folder (a copied run folder continues its copy)."""
        saved_dirpath = state.get("dirpath")
        saved = saved_dirpath if isinstance(saved_dirpath, str) else None

        def name(key: str) -> str:
            value = state.get(key)
            return (_inside(value, saved) or "") if isinstance(value, str) else ""

        last = name("last_model_path")
        if state.get("monitor") != self.monitor:
            warnings.warn(
                f"ModelCheckpoint(monitor={self.monitor!r}) resumes a run that monitored"
                f" {state.get('monitor')!r}: its saved best checkpoints are not ranked by this"
                " metric, so the top k start afresh.",
                stacklevel=2,
            )
            self._resumed = {"saved": saved, "best_k": {}, "best": "", "score": None}
            self._resumed["last"] = last
        else:
            models = state.get("best_k_models")
            best_k = {
                relative: float(score)
                for path, score in (models.items() if isinstance(models, Mapping) else ())
                if isinstance(path, str) and (relative := _inside(path, saved))
            }
            score = state.get("best_model_score")
            self._resumed = {
                "saved": saved,
                "best_k": best_k,
                "best": name("best_model_path"),
                "score": None if score is None else float(score),
                "last": last,
            }
        dirpath = self.dirpath
        if dirpath is None and self._trainer is not None:
            dirpath = default_dirpath(self._trainer, make=False)
        if dirpath is not None:
            self._place(dirpath)  # else: at the first save, when this run's folder is known

    def _place(self, dirpath: str) -> None:
        """Adopt the loaded state's names, in ``dirpath``, for the files that are there."""
        resumed, self._resumed = self._resumed, None
        if resumed is None:
            return

        def here(relative: str) -> str:
            path = os.path.join(dirpath, relative) if relative else ""
            return path if path and os.path.lexists(path) else ""

        best_k = {here(name): score for name, score in resumed["best_k"].items()}
        best_k.pop("", None)
        named = set(resumed["best_k"]) | {resumed["best"], resumed["last"]}
        found = {here(name) for name in named if name} - {""}
        if len(found) < len(named - {""}):
            warnings.warn(
                f"ModelCheckpoint resumes a run that saved to {resumed['saved']!r}: of the"
                f" checkpoints it names, those not in this run's folder {dirpath!r} are"
                " dropped from its bookkeeping (never deleted), and the top k go on with"
                f" {len(best_k)} of its {len(resumed['best_k'])}.",
                stacklevel=3,
            )
        self.dirpath = dirpath  # this run's folder (the one it saves to) in any case
        self.best_k_models = {path: _tensor(score) for path, score in best_k.items()}
        self.best_model_path = here(resumed["best"])
        score = resumed["score"]
        self.best_model_score = (
            None if score is None or not self.best_model_path else _tensor(score)
        )
        self.kth_best_model_path = self._worst(best_k) if best_k else ""
        self.last_model_path = here(resumed["last"])


def _tensor(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64)


def default_dirpath(trainer: Any, make: bool = True) -> str:
    """``<logger.log_dir>/checkpoints``, else ``<default_root_dir>/checkpoints``, else
    ``<cwd>/checkpoints``, as an absolute path; ``make``: the logger's folder is made (its
    version claimed) first."""
    logger = trainer.logger
    maker = getattr(logger, "make_log_dir", None) if make else None
    log_dir = maker() if callable(maker) else getattr(logger, "log_dir", None)
    base = log_dir or trainer.default_root_dir or os.getcwd()
    return os.path.realpath(os.path.join(os.fspath(base), "checkpoints"))


def _inside(path: str, dirpath: str | None) -> str | None:
    """``path`` relative to ``dirpath`` when it names a file inside it (a relative ``path``
    is taken as relative to it already); None for anything else (``..`` and absolute
    paths left after normalising)."""
    if not path:
        return None
    if os.path.isabs(path):
        if dirpath is None:
            return None
        path = os.path.relpath(os.path.normpath(path), os.path.normpath(dirpath))
    path = os.path.normpath(path)
    if path in (".", "") or os.path.isabs(path) or path.split(os.sep)[0] == "..":
        return None
    return path


def claim_marker(path: str) -> str:
    """The file that claims the checkpoint name ``path`` while it is written."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.claim")


def _abandoned(marker: str) -> bool:
    """Whether the writer a claim marker names has ended (a killed writer's claim)."""
    try:
        with open(marker, encoding="ascii", errors="replace") as file:
            found = re.fullmatch(owners.OWNER, file.read(200).strip())
    except OSError:
        return False
    return found is not None and owners.ended(int(found["pid"]), found["start"], found["host"])


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
    if filename is not None:
        _check_template(filename, refuse)
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


def _check_template(filename: str, refuse: Any) -> None:
    """A template that stays inside ``dirpath`` and whose format specs take a number."""
    parts = filename.replace("\\", "/").split("/")
    if os.path.isabs(filename) or ".." in parts:
        raise refuse(
            "filename",
            filename,
            "the name would be written outside dirpath. Give a name inside it (subfolders"
            " such as 'best/{epoch}' are fine), and the folder itself as dirpath=.",
        )
    for match in FIELD.finditer(filename):
        name, spec = match[1], match[2] or ""
        sample: int | float = 0 if name in ("epoch", "step") else 0.0
        try:
            format(sample, spec)
        except (ValueError, TypeError) as error:
            kind, example = ("an int", "03d") if isinstance(sample, int) else ("a float", ".2f")
            raise refuse(
                "filename",
                filename,
                f"the field {match[0]!r} has a format spec that {kind} does not take"
                f" ({error}). Give a number's spec such as '{{{name}:{example}}}', or none.",
            ) from None
