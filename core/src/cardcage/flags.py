"""Every Trainer flag, validated in one place before anything is started."""

from __future__ import annotations

import difflib
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from cardcage.errors import MisconfigurationError

PRECISIONS: tuple[object, ...] = (16, 32, 64, "bf16")
LOG_GPU_MEMORY = (None, "all", "min_max")
GPUS_OVERRIDES = ("CARDCAGE_GPUS", "PL_TRAINER_GPUS")


@dataclass(frozen=True)
class Flags:
    """The Trainer flags that decide where and how training runs.

    Their meanings: the table under "Flags" in docs/choosing-a-backend.md.
    """

    gpus: Any = None
    tpu_cores: Any = None
    num_processes: int = 1
    num_nodes: int = 1
    distributed_backend: str | None = None
    auto_select_gpus: bool = False
    log_gpu_memory: str | None = None
    sync_batchnorm: bool = False
    benchmark: bool = False
    replace_sampler_ddp: bool = True
    precision: int | str = 32
    max_epochs: int | None = 1
    max_steps: int | None = None
    default_root_dir: str | None = None
    resume_from_checkpoint: str | None = None
    max_restarts: int = 0
    checkpoint_every_n_steps: int | None = None
    terminate_on_nan: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


FLAG_NAMES = tuple(f.name for f in fields(Flags))


def _positive_int(name: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        what = "a positive int or None" if allow_none else "a positive int"
        raise MisconfigurationError(f"{name}={value!r} is not valid: {name} must be {what}.")


def _bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise MisconfigurationError(f"{name}={value!r} is not valid: {name} must be True or False.")


def _path(name: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise MisconfigurationError(
            f"{name}={value!r} is not valid: {name} must be a path (str or os.PathLike)."
        )
    return os.fspath(value)  # type: ignore[return-value]


def _writable_folder(name: str, value: object) -> str | None:
    """A path that is a folder this process can write in, or can make and then write in.

    Checked by creating nothing: the nearest folder that exists (the path itself, or the
    parent that ``mkdir -p`` would start from) must take an unnamed temporary file
    (``O_TMPFILE``; where a file system lacks it, a named one removed at once). A test of the
    permission bits alone would pass as root in a read-only place such as ``/proc``.
    """
    path = _path(name, value)
    if path is None:
        return None
    fix = "Give a folder you can write to (it is made when missing), or None to write no file."
    absolute = os.path.abspath(path)
    existing = absolute
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        if os.path.islink(existing) and not os.path.exists(existing):
            what = f"{existing!r} is a link to {os.readlink(existing)!r}, which does not exist"
        elif existing == absolute:
            what = "it is a file, not a folder"
        else:
            what = f"{existing!r} is a file, so no folder can be made below it"
        raise MisconfigurationError(f"{name}={path!r} is not valid: {what}. {fix}")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        code = f" (errno {error.errno})" if error.errno else ""
        where = "" if existing == absolute else f" (in {existing!r}, where it would be made)"
        raise MisconfigurationError(
            f"{name}={path!r} is not writable{where}: no file can be created there: "
            f"{reason[:1].lower()}{reason[1:]}{code}. {fix}"
        ) from None
    return path


def normalize_precision(value: object) -> int | str:
    """``16``/``"16"``/``"16-mixed"`` → 16, ``32``/``"32"`` → 32, ``"bf16"`` stays."""
    aliases: dict[object, int | str] = {
        16: 16,
        "16": 16,
        "16-mixed": 16,
        32: 32,
        "32": 32,
        "32-true": 32,
        64: 64,
        "64": 64,
        "64-true": 64,
        "bf16": "bf16",
        "bf16-mixed": "bf16",
    }
    try:
        known = not isinstance(value, bool) and value in aliases
    except TypeError:  # unhashable, e.g. [16]
        known = False
    if not known:
        raise MisconfigurationError(
            f"precision={value!r} is not supported. Use 32 (full), 16 (float16 autocast "
            "with a grad scaler, CUDA), 'bf16' (bfloat16 autocast), or 64 (double)."
        )
    return aliases[value]


def gpus_override(env: Mapping[str, str]) -> tuple[str, str] | None:
    """``(variable, value)`` of the environment override of ``gpus``, if one is set."""
    for name in GPUS_OVERRIDES:
        value = env.get(name)
        if value is not None and value.strip() != "":
            return name, value
    return None


def validate_flags(**kwargs: Any) -> Flags:
    """Check every flag's type and range; unknown names get a did-you-mean.

    Device-dependent checks (GPU ids against the device count) happen in selection.
    """
    unknown = [k for k in kwargs if k not in FLAG_NAMES]
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, FLAG_NAMES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise MisconfigurationError(
            f"{name}={kwargs[name]!r} is not a cardcage flag.{hint} Known flags: "
            f"{', '.join(FLAG_NAMES)}."
        )
    flags = Flags(**kwargs)
    _positive_int("num_processes", flags.num_processes)
    _positive_int("num_nodes", flags.num_nodes)
    _positive_int("max_epochs", flags.max_epochs, allow_none=True)
    _positive_int("max_steps", flags.max_steps, allow_none=True)
    _positive_int("checkpoint_every_n_steps", flags.checkpoint_every_n_steps, allow_none=True)
    restarts = flags.max_restarts
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise MisconfigurationError(
            f"max_restarts={restarts!r} is not valid: max_restarts must be an int >= 0 (how "
            "many times a job whose rank died starts again; 0 fails at the first death)."
        )
    for name in ("auto_select_gpus", "sync_batchnorm", "benchmark", "replace_sampler_ddp"):
        _bool(name, getattr(flags, name))
    if not isinstance(flags.terminate_on_nan, bool):
        raise MisconfigurationError(
            f"terminate_on_nan={flags.terminate_on_nan!r} is not valid: terminate_on_nan must "
            "be True (fit raises at the first NaN or infinite loss) or False (the default: a "
            "warning names the first such step and training goes on)."
        )
    if flags.distributed_backend is not None and (
        not isinstance(flags.distributed_backend, str) or not flags.distributed_backend.strip()
    ):
        raise MisconfigurationError(
            f"distributed_backend={flags.distributed_backend!r} is not a backend name. Use a "
            "name such as 'ddp', 'ddp_spawn' or 'dp', or None to let cardcage choose."
        )
    if flags.log_gpu_memory not in LOG_GPU_MEMORY:
        raise MisconfigurationError(
            f"log_gpu_memory={flags.log_gpu_memory!r} is not valid. Use None, 'all' or 'min_max'."
        )
    if flags.tpu_cores is not None and flags.gpus not in (None, 0):
        raise MisconfigurationError(
            f"tpu_cores={flags.tpu_cores!r} and gpus={flags.gpus!r} are both set. Train on "
            "TPU cores or on GPUs: unset one of them."
        )
    if flags.auto_select_gpus and flags.gpus is not None and not isinstance(flags.gpus, int):
        raise MisconfigurationError(
            f"auto_select_gpus=True needs gpus to be a count, but gpus={flags.gpus!r} names "
            "GPUs already. Set gpus=N to let cardcage pick N GPUs, or auto_select_gpus=False."
        )
    resume = _path("resume_from_checkpoint", flags.resume_from_checkpoint)
    if resume is not None and not os.path.exists(resume):
        raise MisconfigurationError(
            f"resume_from_checkpoint={resume!r} does not exist. Give the path of a "
            "checkpoint written by trainer.save_checkpoint, or None to start afresh."
        )
    backend = flags.distributed_backend
    return Flags(
        **{
            **flags.as_dict(),
            "distributed_backend": backend.strip().lower() if backend else None,
            "precision": normalize_precision(flags.precision),
            "default_root_dir": _writable_folder("default_root_dir", flags.default_root_dir),
            "resume_from_checkpoint": resume,
            # A tuple of ids reads like a list; any other tuple stays as given, so that the
            # error from device parsing shows the value the user wrote.
            "gpus": list(flags.gpus)
            if isinstance(flags.gpus, tuple) and all(type(i) is int for i in flags.gpus)
            else flags.gpus,
        }
    )


def did_you_mean(name: str, choices: Sequence[str]) -> str:
    """`` Did you mean 'x'?`` or an empty string."""
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""
