"""Checkpoints written atomically and read with ``weights_only=True``.

A checkpoint holds the model, the optimizers, the grad scaler, the epoch, the global step,
the position inside the epoch and the random states needed to draw the same batches again.
It is written to a temporary file in the target folder, flushed to disk, then renamed over
the target: a crash mid-write leaves the previous checkpoint whole.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import torch

from cardcage.errors import MisconfigurationError

FORMAT = "cardcage-checkpoint/1"


def rng_state() -> dict[str, Any]:
    """The random states a resumed run needs (python, torch CPU, CUDA when initialised)."""
    version, state, gauss = random.getstate()
    states: dict[str, Any] = {
        "python": [version, list(state), gauss],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        states["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        kind, keys, pos, has_gauss, cached = numpy.random.get_state(legacy=True)  # type: ignore[misc]
        keys = numpy.asarray(keys, dtype="int64")
        states["numpy"] = [kind, torch.from_numpy(keys), pos, has_gauss, cached]
    except ImportError:
        pass
    return states


def set_rng_state(states: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    version, state, gauss = states["python"]
    random.setstate((version, tuple(state), gauss))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states:
        import numpy

        kind, keys, pos, has_gauss, cached = states["numpy"]
        numpy.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def save_atomic(payload: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``payload`` to ``path`` so that readers see the old file or the new one."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(
        prefix=f".{target.name}.", suffix=".tmp", dir=target.parent
    )
    try:
        with os.fdopen(handle, "wb") as stream:
            torch.save(payload, stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    directory = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself must reach the disk
    finally:
        os.close(directory)
    return target


def load(path: str | os.PathLike[str], map_location: Any = "cpu") -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_atomic`, with ``weights_only=True``."""
    try:
        payload: dict[str, Any] = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise MisconfigurationError(
            f"resume_from_checkpoint={os.fspath(path)!r} does not exist."
        ) from None
    except IsADirectoryError:
        raise MisconfigurationError(
            f"resume_from_checkpoint={os.fspath(path)!r} is a folder: a sharded checkpoint, "
            "which only the backend that wrote it reads. Resume with that distributed_backend, "
            "or give a file written by trainer.save_checkpoint."
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise MisconfigurationError(
            f"resume_from_checkpoint={os.fspath(path)!r} is not a cardcage checkpoint. Give "
            "a file written by trainer.save_checkpoint."
        )
    return payload
