"""Reading the ``gpus`` and ``tpu_cores`` flags, and choosing and exposing GPUs.

The tables are Lightning 1.0's (``None``/``0`` → CPU, ``3`` → ``[0, 1, 2]``, ``-1`` → all,
``"1, 3"`` → ``[1, 3]``, ``"3"`` → ``[3]``). Differences, on purpose: duplicates are
rejected, tuples are accepted like lists, and every error is a
:class:`~cardcage.MisconfigurationError` naming the flag and the value.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

from cardcage.errors import MisconfigurationError

log = logging.getLogger(__name__)

GpusFlag = int | str | Sequence[int] | None
TpuCoresFlag = int | str | Sequence[int] | None


def cuda_device_count() -> int:
    """GPUs visible to torch, read through the two calls tests may patch.

    Neither call creates a CUDA context.
    """
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def _split(value: str, flag: str) -> list[int]:
    pieces = [piece.strip() for piece in value.split(",")]
    try:
        return [int(piece) for piece in pieces if piece]
    except ValueError:
        raise MisconfigurationError(
            f"{flag}={value!r} is not a list of integers. Use an int such as 2, a string "
            "of comma-separated ids such as '0, 1', or '-1' for all."
        ) from None


def _check_type(value: object, flag: str) -> None:
    ok = (
        value is None
        or isinstance(value, (int, str))
        or (isinstance(value, Sequence) and all(isinstance(v, int) for v in value))
    )
    if (
        isinstance(value, bool)
        or not ok
        or (isinstance(value, Sequence) and any(isinstance(v, bool) for v in value))
    ):
        raise MisconfigurationError(
            f"{flag}={value!r} has type {type(value).__name__}; {flag} must be an int, a "
            "string such as '0, 1', a list of ints, or None."
        )


def parse_gpu_ids(
    gpus: GpusFlag, device_count: int | None = None, *, flag: str = "gpus"
) -> list[int] | None:
    """Turn the ``gpus`` flag into a list of GPU ids, or ``None`` for the CPU.

    Args:
        gpus: the flag (``None``, ``0``, ``3``, ``-1``, ``"1, 3"``, ``"-1"``, ``[0, 2]``).
        device_count: GPUs on this machine; read from torch when omitted.
        flag: the name used in error messages (``CARDCAGE_GPUS`` for the override).

    Raises:
        MisconfigurationError: a wrong type, a negative count other than -1, a duplicate
            id, or an id this machine does not have.
    """
    if callable(gpus):
        return None
    _check_type(gpus, flag)
    if gpus is None or (isinstance(gpus, int) and gpus == 0):
        return None
    if isinstance(gpus, str):
        if gpus.strip() == "-1":
            gpus = -1
        else:
            ids = _split(gpus, flag)
            if not ids:
                raise MisconfigurationError(
                    f"{flag}={gpus!r} names no GPU. Use ids such as '0, 1', '-1' for all, "
                    "or leave it unset to train on the CPU."
                )
            return _sanitize(ids, gpus, device_count, flag)
    count = cuda_device_count() if device_count is None else device_count
    if isinstance(gpus, int):
        if gpus < -1:
            raise MisconfigurationError(
                f"{flag}={gpus} is not a GPU count. Use a positive count, -1 for all "
                "GPUs, or 0 / None for the CPU."
            )
        ids = list(range(count)) if gpus == -1 else list(range(gpus))
        if gpus == -1 and not ids:
            raise MisconfigurationError(
                f"{flag}=-1 asks for all GPUs, but this machine has none "
                "(torch.cuda.is_available() is False). Leave gpus unset to train on the CPU."
            )
        return _sanitize(ids, gpus, count, flag)
    ids = list(gpus)
    if not ids:
        raise MisconfigurationError(
            f"{flag}={gpus!r} names no GPU. Leave gpus unset (or 0) to train on the CPU."
        )
    return _sanitize(ids, gpus, count, flag)


def _sanitize(ids: list[int], gpus: object, device_count: int | None, flag: str) -> list[int]:
    # Lists and strings alike: "-2" or "1,-1" are not ids (only "-1" alone means all).
    if any(i < 0 for i in ids):
        raise MisconfigurationError(
            f"{flag}={gpus!r} holds a negative id. List GPU ids (0, 1, ...), or use -1 "
            "alone for all GPUs."
        )
    if len(set(ids)) != len(ids):
        raise MisconfigurationError(
            f"{flag}={gpus!r} names a GPU more than once. List each GPU id once."
        )
    count = cuda_device_count() if device_count is None else device_count
    missing = [i for i in ids if i >= count]
    if missing:
        have = f"GPUs {list(range(count))}" if count else "no GPU"
        raise MisconfigurationError(
            f"{flag}={gpus!r} requests GPU(s) {missing}, but this machine has {have} "
            "(torch.cuda.device_count()). Request fewer GPUs, or leave gpus unset to train "
            "on the CPU."
        )
    return ids


def determine_root_gpu_device(gpu_ids: list[int] | None) -> int | None:
    """The first GPU of the list (where a single-device run trains), or ``None``."""
    if gpu_ids is None:
        return None
    if not isinstance(gpu_ids, list) or not gpu_ids:
        raise MisconfigurationError(f"gpu ids must be a non-empty list, got {gpu_ids!r}.")
    return gpu_ids[0]


def parse_tpu_cores(tpu_cores: TpuCoresFlag) -> int | list[int] | None:
    """Turn the ``tpu_cores`` flag into ``1``, ``8``, ``[k]`` (one core, 1..8) or ``None``.

    Strings split like ``gpus``: ``"8"`` → 8, ``"1,"`` → ``[1]``, ``"3"`` → ``[3]``.
    """
    if callable(tpu_cores):
        return None
    _check_type(tpu_cores, "tpu_cores")
    value: int | list[int] | None
    if isinstance(tpu_cores, str):
        stripped = tpu_cores.strip()
        value = int(stripped) if stripped in ("1", "8") else _split(tpu_cores, "tpu_cores")
    elif isinstance(tpu_cores, Sequence):
        value = [int(core) for core in tpu_cores]
    else:
        value = tpu_cores
    if value is None:
        return None
    if value in (1, 8) and isinstance(value, int):
        return value
    if isinstance(value, list) and len(value) == 1 and 1 <= value[0] <= 8:
        return value
    raise MisconfigurationError(
        f"tpu_cores={tpu_cores!r} is not a TPU core selection. Use 1 (one core), 8 (all "
        "cores of a v2/v3-8), or [k] with k in 1..8 (that one core)."
    )


def nvml_free_memory() -> list[int] | None:
    """Free bytes per GPU through NVML, or ``None`` when NVML is absent; creates no context."""
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
            return [
                int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).free)
                for i in range(count)
            ]
        finally:
            pynvml.nvmlShutdown()
    except Exception as error:  # NVML present but broken: fall back to the probe
        log.debug("NVML failed: %s", error)
        return None


def probe_gpu(device: int) -> bool:
    """The seed's test: can a small tensor be allocated on ``device``?"""
    import torch

    try:
        torch.ones(1, device=f"cuda:{device}")
    except RuntimeError:
        return False
    return True


def pick_multiple_gpus(
    count: int,
    *,
    free_memory: Callable[[], list[int] | None] = nvml_free_memory,
    probe: Callable[[int], bool] = probe_gpu,
    device_count: int | None = None,
    attempts: int = 3,
    sleep: Callable[[float], None] = time.sleep,
) -> list[int]:
    """Choose ``count`` GPUs (-1: all) for ``auto_select_gpus``.

    With NVML, GPUs are ranked by free memory (most first). Without it, each GPU is probed by
    allocating a tensor, as Lightning 1.0 did (this creates a CUDA context, so it runs when
    training starts, never in :func:`cardcage.select`). A short jittered back-off between
    attempts lets a GPU freed by a job that is ending become usable.
    """
    if count == 0:
        raise MisconfigurationError(
            "auto_select_gpus=True with gpus=0 selects nothing. Set gpus to the number of "
            "GPUs to pick, or auto_select_gpus=False."
        )
    if isinstance(count, bool) or not isinstance(count, int) or count < -1:
        raise MisconfigurationError(
            f"auto_select_gpus=True with gpus={count!r}: gpus must be a positive count of "
            "GPUs to pick, or -1 for all."
        )
    total = cuda_device_count() if device_count is None else device_count
    wanted = total if count == -1 else count
    if wanted > total:
        raise MisconfigurationError(
            f"auto_select_gpus=True with gpus={count} asks for more GPUs than this machine "
            f"has ({total}). Ask for at most {total}."
        )
    usable: list[int] = []
    for attempt in range(attempts):
        free = free_memory()
        # NVML counts every GPU of the machine; when CUDA_VISIBLE_DEVICES hides some, its
        # indices are not torch's, so only a list of torch's length is trusted.
        if free is not None and len(free) == total:
            return sorted(sorted(range(total), key=lambda i: -free[i])[:wanted])
        usable = [i for i in range(total) if probe(i)]
        if len(usable) >= wanted:
            return usable[:wanted]
        if attempt + 1 < attempts:
            sleep((2**attempt) * 0.5 + random.uniform(0, 0.5))
    raise MisconfigurationError(
        f"auto_select_gpus=True with gpus={count}: only {len(usable)} of {total} GPUs accept "
        "an allocation (the others are busy or exclusive). Free GPUs, or ask for fewer."
    )


def apply_cuda_environment(
    gpu_ids: list[int] | None,
    *,
    slurm_managing_tasks: bool,
    environ: MutableMapping[str, str] | None = None,
) -> dict[str, Any]:
    """Set the seed's CUDA variables when training starts (never in ``select``).

    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so ids match ``nvidia-smi``. ``CUDA_VISIBLE_DEVICES`` is
    left to SLURM when it manages tasks, and to the user when already set; otherwise it
    lists every GPU so that the ids the user gave stay valid. Returns what was set.
    """
    target = os.environ if environ is None else environ
    changed: dict[str, Any] = {}
    if target.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        target["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        changed["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if gpu_ids and not slurm_managing_tasks and "CUDA_VISIBLE_DEVICES" not in target:
        visible = ",".join(str(i) for i in range(max(gpu_ids) + 1))
        target["CUDA_VISIBLE_DEVICES"] = visible
        changed["CUDA_VISIBLE_DEVICES"] = visible
    return changed


def gpu_memory_metrics(mode: str | None, gpu_ids: list[int] | None) -> dict[str, float]:
    """Allocated GPU memory in MiB for ``log_gpu_memory``: per GPU (``"all"``) or min/max."""
    if not mode or not gpu_ids:
        return {}
    import torch

    used = {i: torch.cuda.memory_allocated(i) / 2**20 for i in gpu_ids}
    if mode == "min_max":
        return {"gpu_memory_min_mb": min(used.values()), "gpu_memory_max_mb": max(used.values())}
    return {f"gpu_{i}_memory_mb": value for i, value in used.items()}
