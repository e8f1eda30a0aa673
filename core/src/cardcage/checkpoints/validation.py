"""Opening ``resume_from_checkpoint`` and saying what is wrong with it.

:func:`check_resume` opens the checkpoint once, in the process that called ``fit``, before
any process starts, and checks that it is a cardcage checkpoint whose model state fits the
model (a backend's folder format too) and whose optimizer states fit the model's optimizers
(what ``configure_optimizers()`` returns there, on a throw-away basis). :func:`read` is how
:func:`cardcage.checkpoints.io.load` reads a file. Every failure (missing, empty, truncated, not
a torch file, refused by ``weights_only``, not a cardcage checkpoint, not the model's, not
its optimizers') raises :class:`~cardcage.errors.MisconfigurationError` saying which.
Writing checkpoints is :mod:`cardcage.checkpoints.io`'s.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from cardcage.errors import MisconfigurationError

#: The format of a cardcage checkpoint: what ``trainer.loop_state()`` writes, what is read.
FORMAT = "cardcage-checkpoint/1"

FLAG = "resume_from_checkpoint"
#: Who writes what the Trainer reads back (named in the fixes of its refusals).
TRAINER = "trainer.save_checkpoint"
#: What :func:`cardcage.train.resume.restore` and the loop read from a checkpoint besides the model.
LOOP_KEYS = ("optimizers", "schedulers", "scaler", "epoch", "global_step", "batch_idx", "rng")
#: The class name of each optimizer whose state ``"optimizers"`` holds (``trainer.loop_state()``
#: writes it); a checkpoint without it is judged by its parameter groups' keys.
OPTIMIZER_TYPES = "optimizer_types"
#: A checkpoint that is a folder (a backend's sharded format, e.g. fsdp's): the file beside
#: the shards that holds everything but the model (``trainer.loop_state()`` and optimizer
#: settings), and the index that torch.distributed.checkpoint writes.
LOOP_FILE = "loop.pt"
DCP_METADATA = ".metadata"
#: How many offending keys an error names.
SHOWN = 5


@dataclass(frozen=True)
class Checked:
    """A checkpoint :func:`check_resume` accepted: its path, which file version it read
    (device, inode, size, modification time) and, for a one-file checkpoint, its content."""

    path: str
    stamp: tuple[int, ...]
    payload: dict[str, Any] | None

    def is_file(self, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` is the file that was read, unchanged since."""
        try:
            return self.payload is not None and _stamp(path) == self.stamp
        except OSError:
            return False


def _stamp(path: str | os.PathLike[str]) -> tuple[int, ...]:
    info = os.stat(path)
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def check_resume(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    *,
    reads_folders: bool,
    backend: str,
    optimizers: Sequence[torch.optim.Optimizer] | None = None,
) -> Checked:
    """Open ``resume_from_checkpoint`` once, in the process that called ``fit``, before any
    process starts: it exists, is a cardcage checkpoint, loads with ``weights_only=True``,
    its model state fits ``model`` (keys and shapes), and its optimizer states fit
    ``optimizers`` (what ``model.configure_optimizers()`` returns; see
    :func:`check_optimizers`). Raise :class:`~cardcage.errors.MisconfigurationError` saying
    what is wrong otherwise.

    A folder is a backend's own format: accepted when the backend reads folders
    (``reads_folders``: it has its own ``load_checkpoint``); its ``loop.pt`` is checked, and
    for a torch.distributed.checkpoint folder the model's keys and shapes in ``.metadata``.
    """
    name = os.fspath(path)
    where = f"{FLAG}={name!r}"
    if os.path.isdir(name):
        folder = _check_folder(Path(name), model, reads_folders, backend, optimizers)
        return Checked(name, _stamp(name), folder)
    stamp = _stamp_of(name, where)
    payload = _read(name, where, "cpu")
    _check_format(payload, where)
    missing = [key for key in ("state_dict", *LOOP_KEYS) if key not in payload]
    if missing:
        raise MisconfigurationError(
            f"{where} is not a cardcage checkpoint: it has no {_names(missing)} (it holds "
            f"{_names(list(payload))}). Give a file written by trainer.save_checkpoint."
        )
    state = payload["state_dict"]
    if not isinstance(state, dict):
        raise MisconfigurationError(
            f"{where} is not a cardcage checkpoint: its 'state_dict' is a "
            f"{type(state).__name__}, not a dict of tensors. Give a file written by "
            "trainer.save_checkpoint."
        )
    shapes = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in state.items()}
    _check_fit(shapes, model, where)
    if optimizers is not None:
        check_optimizers(payload["optimizers"], payload.get(OPTIMIZER_TYPES), optimizers, where)
    return Checked(name, stamp, payload)


def read(path: str | os.PathLike[str], map_location: Any = "cpu") -> dict[str, Any]:
    """The cardcage checkpoint at ``path``, read with ``weights_only=True`` (what
    :func:`cardcage.checkpoints.io.load` reads a file with)."""
    where = f"{FLAG}={os.fspath(path)!r}"
    payload = _read(path, where, map_location)
    _check_format(payload, where)
    loaded: dict[str, Any] = payload
    return loaded


def read_saved(
    path: str | os.PathLike[str], where: str, writer: str, map_location: Any = "cpu"
) -> Any:
    """What ``path`` holds, read with ``weights_only=True``; every failure (missing, a
    folder, empty, truncated, an object weights_only refuses) a MisconfigurationError that
    starts with ``where``, says what is not allowed and asks for a file written by
    ``writer`` (``"cage.save"``): never a suggestion to load with ``weights_only=False``."""
    return _read(path, where, map_location, writer)


def _stamp_of(name: str, where: str) -> tuple[int, ...]:
    info = _stat(name, where)
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def _stat(path: str | os.PathLike[str], where: str, writer: str = TRAINER) -> os.stat_result:
    """``os.stat(path)``; a missing or unreadable file is a MisconfigurationError."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        start = ", or None to start afresh" if writer == TRAINER else ""
        raise MisconfigurationError(
            f"{where} does not exist. Give the path of a checkpoint written by {writer}{start}."
        ) from None
    except OSError as error:
        raise MisconfigurationError(f"{where} cannot be read: {_reason(error)}.") from None


def _check_folder(
    folder: Path,
    model: torch.nn.Module,
    reads_folders: bool,
    backend: str,
    optimizers: Sequence[torch.optim.Optimizer] | None,
) -> dict[str, Any] | None:
    where = f"{FLAG}={os.fspath(folder)!r}"
    if not reads_folders:
        raise MisconfigurationError(_folder_refused(where, backend))
    try:
        entries = {entry.name for entry in folder.iterdir()}
    except OSError as error:
        raise MisconfigurationError(f"{where} cannot be read: {_reason(error)}.") from None
    if not entries:
        raise MisconfigurationError(
            f"{where} is an empty folder, not a checkpoint: was its writing interrupted? Give "
            "a checkpoint written by trainer.save_checkpoint."
        )
    if LOOP_FILE not in entries:
        if DCP_METADATA in entries:
            raise MisconfigurationError(
                f"{where} is a torch.distributed.checkpoint folder without {LOOP_FILE}: not a "
                "cardcage checkpoint (trainer.save_checkpoint writes the loop's state there, "
                "beside the shards). Give a checkpoint written by trainer.save_checkpoint."
            )
        return None  # the backend's own format: it reads and checks it
    inner = f"{where} (its {LOOP_FILE})"
    loop = _read(folder / LOOP_FILE, inner, "cpu")
    _check_format(loop, inner)
    sharded = DCP_METADATA in entries  # else a format of the backend's, optimizers apart
    wanted = [key for key in LOOP_KEYS if sharded or key != "optimizers"]
    missing = [key for key in wanted if key not in loop]
    if missing:
        raise MisconfigurationError(
            f"{inner} is not a cardcage checkpoint: it has no {_names(missing)}. Give a "
            "checkpoint written by trainer.save_checkpoint."
        )
    if sharded:
        _check_fit(_dcp_model_shapes(folder, where), model, where)
    if optimizers is not None and "optimizers" in loop:
        # A sharded folder keeps the states of stepped optimizers in its shards (None here).
        check_optimizers(loop["optimizers"], loop.get(OPTIMIZER_TYPES), optimizers, where)
    return None


def _dcp_model_shapes(folder: Path, where: str) -> dict[str, tuple[int, ...] | None]:
    """The model's keys and global shapes in a torch.distributed.checkpoint index, as the
    backend that reads the folder would read it (``FileSystemReader.read_metadata``)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = FileSystemReader(os.fspath(folder)).read_metadata()
        entries = dict(metadata.state_dict_metadata)
    except Exception as error:
        raise MisconfigurationError(
            f"{where}: its {DCP_METADATA} is truncated or not torch.distributed.checkpoint's "
            f"({_said(error)}). Give a checkpoint written by trainer.save_checkpoint."
        ) from None
    prefix = "model."
    return {
        key[len(prefix) :]: tuple(value.size) if isinstance(value, TensorStorageMetadata) else None
        for key, value in entries.items()
        if key.startswith(prefix)
    }


def _check_fit(
    saved: dict[str, tuple[int, ...] | None], model: torch.nn.Module, where: str
) -> None:
    """The checkpoint's model keys and shapes against ``model``'s."""
    expected = model.state_dict()
    missing = [key for key in expected if key not in saved]
    unexpected = [key for key in saved if key not in expected]
    mismatched = []
    for key, value in expected.items():
        shape = saved.get(key)
        if (
            shape is not None
            and isinstance(value, torch.Tensor)
            and not is_lazy(value)
            and tuple(value.shape) != shape
        ):
            mismatched.append(f"{key!r} is {list(shape)} there, {list(value.shape)} in the model")
    if not (missing or unexpected or mismatched):
        return
    problems = []
    if missing:
        problems.append(f"keys of the model it lacks: {_names(missing)}")
    if unexpected:
        problems.append(f"keys it holds that the model lacks: {_names(unexpected)}")
    if mismatched:
        problems.append(f"shapes that differ: {_listed(mismatched)}")
    raise MisconfigurationError(
        f"{where} does not fit the model ({type(model).__name__}): {'; '.join(problems)}. "
        "Resume with the model that wrote it (same class and sizes), or None to start afresh."
    )


def check_optimizers(
    saved: Any,
    types: Any,
    optimizers: Sequence[torch.optim.Optimizer],
    where: str,
) -> None:
    """A checkpoint's optimizer states (``saved``, a list of ``optimizer.state_dict()``; an
    entry may be ``None`` where a sharded folder keeps it in its shards) against the
    ``optimizers`` that ``configure_optimizers()`` returns: their count, each one's type
    (``types``, the class names the checkpoint recorded; without them, its parameter groups'
    keys), parameter groups (count, sizes) and which parameters its state is for.

    Every one of these fails only later, in a training process, as a bare ``KeyError`` or
    ``ValueError`` from torch (an SGD state resumed into Adam: ``KeyError: 'betas'``).
    """
    fix = (
        "Resume with the configure_optimizers() that wrote it (the same optimizers, in the "
        "same order, over the same parameters), or None to start afresh."
    )
    if not isinstance(saved, (list, tuple)):
        raise MisconfigurationError(
            f"{where} is not a cardcage checkpoint: its 'optimizers' is a "
            f"{type(saved).__name__}, not a list of optimizer states. Give a file written by "
            "trainer.save_checkpoint."
        )
    if len(saved) != len(optimizers):
        names = ", ".join(type(o).__name__ for o in optimizers)
        raise MisconfigurationError(
            f"{where} holds {len(saved)} optimizer state(s), but configure_optimizers() "
            f"returns {len(optimizers)} ({names}). {fix}"
        )
    recorded = list(types) if isinstance(types, (list, tuple)) else []
    for index, (optimizer, state) in enumerate(zip(optimizers, saved, strict=True)):
        kind = type(optimizer).__name__
        recorded_kind = recorded[index] if index < len(recorded) else None
        problem = _optimizer_problem(optimizer, state, recorded_kind)
        if problem:
            raise MisconfigurationError(
                f"{where} does not fit optimizer {index} ({kind}) of configure_optimizers(): "
                f"{problem}. {fix}"
            )


def _optimizer_problem(optimizer: torch.optim.Optimizer, state: Any, recorded: Any) -> str | None:
    """What differs between ``optimizer`` and its ``state`` in a checkpoint, or ``None``."""
    kind = type(optimizer).__name__
    if isinstance(recorded, str) and recorded != kind:
        return f"it holds a state of {recorded}, not of {kind}"
    if state is None:  # kept in a sharded folder's shards: the backend reads it
        return None
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, dict) for g in groups):
        return "its state is not an optimizer.state_dict() (no list of 'param_groups')"
    if not isinstance(recorded, str):
        differs = _other_optimizer(optimizer, groups)
        if differs:
            return differs
    live = optimizer.param_groups
    if len(groups) != len(live):
        return f"it holds {len(groups)} parameter group(s), {kind} has {len(live)}"
    sizes = [len(g.get("params", ())) for g in groups]
    wanted = [len(g["params"]) for g in live]
    if sizes != wanted:
        shown = [
            f"group {i} holds {there} parameter(s) there, {here} here"
            for i, (there, here) in enumerate(zip(sizes, wanted, strict=True))
            if there != here
        ]
        return f"its parameter groups differ in size: {_listed(shown)}"
    held = {p for g in groups for p in g.get("params", ())}
    per_parameter = state.get("state", {})
    strays = (
        [key for key in per_parameter if key not in held] if isinstance(per_parameter, dict) else []
    )
    if strays:
        return (
            f"its state is for parameters {_listed([repr(k) for k in strays])}, which none of "
            "its parameter groups holds"
        )
    return None


def _other_optimizer(
    optimizer: torch.optim.Optimizer, groups: Sequence[dict[str, Any]]
) -> str | None:
    """For a checkpoint that did not record its optimizers' classes: whether its parameter
    groups are another optimizer's. They are when they lack settings of ``optimizer``'s and
    hold settings it has not: one of the two alone is a torch version adding or dropping a
    setting (torch fills in a missing one when it loads a state)."""
    kind = type(optimizer).__name__
    if not groups:
        return None
    theirs = set(groups[0]) - {"params"}
    ours = set(optimizer.defaults)
    known = ours.union(*(set(g) for g in optimizer.param_groups))  # a scheduler's "initial_lr"...
    lacks = sorted(ours - theirs)
    extra = sorted(theirs - known)
    if not (lacks and extra):
        return None
    return (
        f"it holds the state of another optimizer: its parameter groups hold "
        f"{_names(extra)}, which {kind} has not, and lack {kind}'s {_names(lacks)}"
    )


def _read(
    path: str | os.PathLike[str], where: str, map_location: Any, writer: str = TRAINER
) -> Any:
    """``torch.load(path, weights_only=True)``, every failure a MisconfigurationError."""
    size = _stat(path, where, writer).st_size
    if os.path.isdir(path):
        if writer != TRAINER:
            raise MisconfigurationError(f"{where} is a folder. Give a file written by {writer}.")
        raise MisconfigurationError(_folder_refused(where, None))
    if size == 0:
        raise MisconfigurationError(
            f"{where} is empty (0 bytes): was its writing interrupted? Give a complete "
            f"checkpoint written by {writer}."
        )
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        said = str(error)
        # "Unsupported operand": bytes that are no pickle torch knows (garbage, a plain
        # pickle), rather than an object it refused.
        if "weights only load failed" not in said.lower() or "Unsupported operand" in said:
            reason = _weights_only_reason(error)
            raise MisconfigurationError(_truncated(where, size, reason, writer)) from None
        raise MisconfigurationError(_refused(where, said, writer)) from None
    except MemoryError:
        raise
    except OSError as error:
        if error.errno not in (errno.EINVAL, None):  # EINVAL: a seek past a truncated end
            raise MisconfigurationError(f"{where} cannot be read: {_reason(error)}.") from None
        raise MisconfigurationError(_truncated(where, size, error, writer)) from None
    except Exception as error:  # EOFError, IndexError, KeyError, RuntimeError of the reader
        raise MisconfigurationError(_truncated(where, size, error, writer)) from None


def _check_format(payload: Any, where: str) -> None:
    fix = "Give a file written by trainer.save_checkpoint."
    if not isinstance(payload, dict):
        raise MisconfigurationError(
            f"{where} is not a cardcage checkpoint: it holds a {type(payload).__name__}, not "
            f"the dict that trainer.save_checkpoint writes. {fix}"
        )
    if "format" not in payload:
        if payload and all(isinstance(v, torch.Tensor) for v in payload.values()):
            raise MisconfigurationError(
                f"{where} is not a cardcage checkpoint: it holds only tensors ("
                f"{_names(list(payload))}), a model's state_dict alone. Load such weights "
                "with model.load_state_dict(torch.load(path, weights_only=True)) before fit, "
                f"and leave {FLAG}=None; {FLAG} takes a file written by "
                "trainer.save_checkpoint."
            )
        what = "no 'state_dict'" if "state_dict" not in payload else "no 'format'"
        raise MisconfigurationError(
            f"{where} is not a cardcage checkpoint: it has {what} (it holds "
            f"{_names(list(payload)) if payload else 'nothing'}). {fix}"
        )
    if payload["format"] != FORMAT:
        raise MisconfigurationError(
            f"{where} is not a cardcage checkpoint of this version: its format is "
            f"{payload['format']!r}, and cardcage reads {FORMAT!r}. {fix}"
        )


def _folder_refused(where: str, backend: str | None) -> str:
    reader = f"distributed_backend={backend!r} reads" if backend else "this backend reads"
    return (
        f"{where} is a folder: a sharded checkpoint, which only the backend that wrote it "
        f"reads, and {reader} only files. Resume with that distributed_backend, or give a "
        "file written by trainer.save_checkpoint."
    )


def _refused(where: str, said: str, writer: str = TRAINER) -> str:
    found = re.search(r"GLOBAL (\S+) was not an allowed global", said) or re.search(
        r"unsupported GLOBAL (\S+) whose module", said
    )
    if found:
        holds = f"it holds an object of {found.group(1)}, not only tensors and plain containers"
    else:
        detail = re.search(r"WeightsUnpickler error:\s*(.+)", said)
        holds = (
            "it holds objects other than tensors and plain containers (torch said: "
            f"{detail.group(1).strip() if detail else 'unsupported content'})"
        )
    return (
        f"{where} was refused by torch.load(weights_only=True): {holds}. Loading such a file "
        "can run any code it names, and cardcage never loads one. Give a checkpoint written "
        f"by {writer} (tensors, numbers, strings, lists and dicts only)."
    )


def _weights_only_reason(error: pickle.UnpicklingError) -> BaseException:
    """The line of torch's weights_only message that says what it could not read."""
    detail = re.search(r"WeightsUnpickler error:\s*(.+)", str(error))
    return pickle.UnpicklingError(detail.group(1).strip()) if detail else error


def _truncated(where: str, size: int, error: BaseException, writer: str = TRAINER) -> str:
    return (
        f"{where} is truncated or not a torch file ({size} bytes; torch.load said: "
        f"{_said(error)}). Give a complete checkpoint written by {writer}."
    )


def _said(error: BaseException) -> str:
    """The first line of ``error``'s message, without terminal colours, at most 160 chars."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip().splitlines()
    line = text[0].strip() if text else ""
    if len(line) > 160:
        line = line[:157] + "..."
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


def _reason(error: OSError) -> str:
    if error.errno:
        reason = os.strerror(error.errno)
        return f"{reason[:1].lower()}{reason[1:]} (errno {error.errno})"
    return _said(error)


def _names(keys: list[str]) -> str:
    return _listed([repr(key) for key in keys])


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:SHOWN])
    return shown + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "")
