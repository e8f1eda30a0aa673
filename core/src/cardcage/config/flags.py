"""Every Trainer flag, validated in one place before anything is started."""

from __future__ import annotations

import difflib
import math
import os
import resource
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
    find_unused_parameters: bool | None = None
    precision: int | str = 32
    max_epochs: int | None = 1
    max_steps: int | None = None
    default_root_dir: str | None = None
    resume_from_checkpoint: str | None = None
    max_restarts: int = 0
    checkpoint_every_n_steps: int | None = None
    terminate_on_nan: bool = False
    progress_bar: bool | None = None
    # The loop's flags (docs/training-loop.md)
    accumulate_grad_batches: int = 1
    gradient_clip_val: float = 0.0
    gradient_clip_algorithm: str = "norm"
    deterministic: bool = False
    fast_dev_run: bool | int = False
    limit_train_batches: float | int = 1.0
    limit_val_batches: float | int = 1.0
    limit_test_batches: float | int = 1.0
    check_val_every_n_epoch: int = 1
    min_epochs: int | None = None
    log_every_n_steps: int = 50
    num_sanity_val_steps: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


#: The flags that hold objects the loop calls (callbacks, loggers): the Trainer keeps them
#: beside :class:`Flags`, which holds plain values only (a selection prints them).
OBJECT_FLAGS = ("callbacks", "logger")

FLAG_NAMES = tuple(f.name for f in fields(Flags)) + OBJECT_FLAGS

#: Lightning 1.0 flags cardcage does not run: refused by name, never with a did-you-mean
#: towards another flag, and never ignored.
NOT_SUPPORTED_YET: tuple[str, ...] = (
    "val_check_interval",
    "track_grad_norm",
    "truncated_bptt_steps",
    "auto_lr_find",
    "auto_scale_batch_size",
    "overfit_batches",
    "reload_dataloaders_every_epoch",
    "weights_summary",
    "weights_save_path",
    "flush_logs_every_n_steps",
    "process_position",
    "profiler",
    "amp_backend",
    "amp_level",
    "prepare_data_per_node",
    "plugins",
    "checkpoint_callback",
    "automatic_optimization",
    "move_metrics_to_cpu",
)

#: Flags of later Lightning versions (1.5 and after); the 1.0 flags that do the same.
LATER_FLAGS = ("strategy", "accelerator", "devices")


def _later_flag(kwargs: Mapping[str, Any]) -> str:
    """The message for ``strategy``/``accelerator``/``devices``: the 1.0 flags that do it."""
    later = [k for k in LATER_FLAGS if k in kwargs]
    given = ", ".join(f"{k}={kwargs[k]!r}" for k in later)
    what = f"{given} {'is a flag' if len(later) == 1 else 'are flags'} of later Lightning "
    what += "versions; cardcage takes Lightning 1.0's flags."
    accelerator = kwargs.get("accelerator")
    devices = kwargs.get("devices")
    kind = accelerator.strip().lower() if isinstance(accelerator, str) else accelerator
    fixes: list[str] = []
    if "strategy" in kwargs:
        strategy = kwargs["strategy"]
        name = strategy if isinstance(strategy, str) else "ddp"
        fixes.append(f"distributed_backend={name!r} instead of strategy")
    count = devices if devices is not None else "N"
    if kind in ("gpu", "cuda"):
        fixes.append(f"gpus={count!r} instead of accelerator={accelerator!r}, devices")
    elif kind == "cpu":
        if devices is None:
            fixes.append("distributed_backend='cpu' (or no flag) instead of accelerator='cpu'")
        else:
            fixes.append(
                f"num_processes={count!r} with distributed_backend='ddp_cpu' instead of "
                f"accelerator='cpu', devices={devices!r}"
            )
    elif kind == "tpu":
        fixes.append(f"tpu_cores={count!r} instead of accelerator='tpu', devices")
    elif "accelerator" in kwargs or "devices" in kwargs:
        fixes.append(
            f"gpus={count!r} (GPUs), tpu_cores={count!r} (TPU cores) or num_processes="
            f"{count!r} with distributed_backend='ddp_cpu' (CPU processes) instead of "
            + ("devices" if "accelerator" not in kwargs else "accelerator and devices")
        )
    return f"{what} Use {'; '.join(fixes)}."


def _unknown_flag(name: str, value: object) -> str:
    if name in NOT_SUPPORTED_YET:
        return (
            f"{name}={value!r} is Lightning 1.0's flag, which cardcage does not support yet. "
            f"Leave {name} out (training would not do what it asks), or train with Lightning "
            "where you need it."
        )
    hint = did_you_mean(name, FLAG_NAMES)
    return f"{name}={value!r} is not a cardcage flag.{hint} Known flags: {', '.join(FLAG_NAMES)}."


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


WRITABLE_FIX = "Give a folder you can write to (it is made when missing), or None to write no file."


def writable_folder(
    name: str,
    value: object,
    close: str = "",
    fix: str = WRITABLE_FIX,
) -> str | None:
    """A path that is a folder this process can write in, or can make and then write in.

    ``name``, ``close`` and ``fix`` make the message: ``<name>=<value><close> is not
    writable ... <fix>`` (``"CSVLogger(save_dir", close=")"`` for an argument).

    Checked by creating nothing: the nearest folder that exists (the path itself, or the
    parent that ``mkdir -p`` would start from) must take an unnamed temporary file
    (``O_TMPFILE``; where a file system lacks it, a named one removed at once). A test of the
    permission bits alone would pass as root in a read-only place such as ``/proc``.
    """
    path = _path(name, value)
    if path is None:
        return None
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
        raise MisconfigurationError(f"{name}={path!r}{close} is not valid: {what}. {fix}")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        code = f" (errno {error.errno})" if error.errno else ""
        where = "" if existing == absolute else f" (in {existing!r}, where it would be made)"
        raise MisconfigurationError(
            f"{name}={path!r}{close} is not writable{where}: no file can be created there: "
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
    if any(k in kwargs for k in LATER_FLAGS):
        raise MisconfigurationError(_later_flag(kwargs))
    unknown = [k for k in kwargs if k not in FLAG_NAMES]
    if unknown:
        raise MisconfigurationError(_unknown_flag(unknown[0], kwargs[unknown[0]]))
    kwargs = dict(kwargs)
    check_callbacks(kwargs.pop("callbacks", None))
    check_logger(kwargs.pop("logger", True))
    flags = Flags(**kwargs)
    _check_loop_flags(flags)
    if flags.progress_bar is not None and not isinstance(flags.progress_bar, bool):
        raise MisconfigurationError(
            f"progress_bar={flags.progress_bar!r} is not valid: Use True, False or None (a bar "
            "when stderr is a terminal)."
        )
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
    if flags.find_unused_parameters is not None and not isinstance(
        flags.find_unused_parameters, bool
    ):
        raise MisconfigurationError(
            f"find_unused_parameters={flags.find_unused_parameters!r} is not valid: use True "
            "(DistributedDataParallel looks for parameters a step leaves unused), False, or "
            "None (True for a training_step that takes optimizer_idx, else False)."
        )
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
            "default_root_dir": writable_folder("default_root_dir", flags.default_root_dir),
            "resume_from_checkpoint": resume,
            # A tuple of ids reads like a list; any other tuple stays as given, so that the
            # error from device parsing shows the value the user wrote.
            "gpus": list(flags.gpus)
            if isinstance(flags.gpus, tuple) and all(type(i) is int for i in flags.gpus)
            else flags.gpus,
        }
    )


def _number_or_fraction(name: str, value: object) -> None:
    """``limit_*_batches``: a fraction in [0, 1] (float) or a count >= 0 (int)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MisconfigurationError(
            f"{name}={value!r} is not valid: give a fraction of the batches (a float from 0.0 "
            "to 1.0) or a number of batches (an int >= 0)."
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise MisconfigurationError(
            f"{name}={value!r} is not valid: give a fraction of the batches (a float from 0.0 "
            "to 1.0, 1.0 for all of them) or a number of batches (an int >= 0)."
        )
    if isinstance(value, float) and not 0.0 <= value <= 1.0:
        raise MisconfigurationError(
            f"{name}={value!r} is not valid: a float is a fraction of the batches and must be "
            f"from 0.0 to 1.0; give an int ({int(value)}) for a number of batches."
        )
    if isinstance(value, int) and value < 0:
        raise MisconfigurationError(
            f"{name}={value!r} is not valid: a number of batches must be >= 0."
        )


def _check_loop_flags(flags: Flags) -> None:
    """The loop's flags: types and ranges (their meanings: docs/training-loop.md)."""
    _positive_int("accumulate_grad_batches", flags.accumulate_grad_batches)
    _positive_int("check_val_every_n_epoch", flags.check_val_every_n_epoch)
    _positive_int("log_every_n_steps", flags.log_every_n_steps)
    _positive_int("min_epochs", flags.min_epochs, allow_none=True)
    _bool("deterministic", flags.deterministic)
    clip = flags.gradient_clip_val
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0 <= clip < math.inf:
        raise MisconfigurationError(
            f"gradient_clip_val={clip!r} is not valid: give a finite number > 0 to clip the "
            "gradients to, or 0 (the default) not to clip."
        )
    if flags.gradient_clip_algorithm not in ("norm", "value"):
        raise MisconfigurationError(
            f"gradient_clip_algorithm={flags.gradient_clip_algorithm!r} is not valid: use "
            "'norm' (clip the total 2-norm of the gradients) or 'value' (clamp each element)."
        )
    fast = flags.fast_dev_run
    if not isinstance(fast, (bool, int)) or (not isinstance(fast, bool) and fast < 0):
        raise MisconfigurationError(
            f"fast_dev_run={fast!r} is not valid: use True (one batch of training and of "
            "validation), an int n >= 0 (n batches each) or False."
        )
    for name in ("limit_train_batches", "limit_val_batches", "limit_test_batches"):
        _number_or_fraction(name, getattr(flags, name))
    sanity = flags.num_sanity_val_steps
    if isinstance(sanity, bool) or not isinstance(sanity, int) or sanity < -1:
        raise MisconfigurationError(
            f"num_sanity_val_steps={sanity!r} is not valid: give the number of validation "
            "batches to run before training (0, the default, runs none), or -1 for all."
        )
    if (
        flags.min_epochs is not None
        and flags.max_epochs is not None
        and flags.min_epochs > flags.max_epochs
    ):
        raise MisconfigurationError(
            f"min_epochs={flags.min_epochs} is more than max_epochs={flags.max_epochs}: "
            "training could not run both. Lower min_epochs or raise max_epochs."
        )


def check_callbacks(value: object) -> None:
    """``callbacks``: None or a list of callback objects (``cardcage.Callback``)."""
    if value is None:
        return
    if not isinstance(value, (list, tuple)):
        value = [value] if _is_callback(value) else value
        if not isinstance(value, list):
            raise MisconfigurationError(
                f"callbacks={value!r} is not valid: give a list of cardcage.Callback objects."
            )
    for i, item in enumerate(value):
        if not _is_callback(item):
            what = "a class, not an instance" if isinstance(item, type) else "not a Callback"
            raise MisconfigurationError(
                f"callbacks[{i}]={item!r} is {what}. Give instances of cardcage.Callback "
                "subclasses (e.g. cardcage.callbacks.ModelCheckpoint(monitor='val_loss'))."
            )


def _is_callback(item: object) -> bool:
    """A callback: an instance whose class has the hooks of ``cardcage.Callback`` (so a
    Lightning callback ported by hand, which subclasses it, qualifies)."""
    return not isinstance(item, type) and callable(getattr(item, "on_train_epoch_end", None))


def check_logger(value: object) -> None:
    """``logger``: True (a CSV logger under default_root_dir), False/None, a logger object,
    a list of them, or the name of a logger a plugin registers (resolved by the Trainer)."""
    if value is None or isinstance(value, (bool, str)):
        return
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if not callable(getattr(item, "log_metrics", None)) or isinstance(item, type):
            raise MisconfigurationError(
                f"logger={value!r} is not valid: {item!r} is not a logger. Use True (a CSV "
                "logger under default_root_dir), False, a logger object such as "
                "cardcage.loggers.CSVLogger('logs'), a list of them, or the name of a logger "
                "a plugin registers."
            )


# -- how many processes this machine can start -----------------------------------------------

#: Tasks (threads) a CPU rank holds while it trains: measured 5 (its main thread, torch's
#: and gloo's) for a ddp_spawn worker on a two-core machine; 4 is the floor used here.
TASKS_PER_PROCESS = 4
#: Memory a rank takes before its model: importing torch alone holds 143 MiB of anonymous
#: memory (RssAnon), a training worker 213 MiB; 128 MiB is the floor used here.
MEMORY_PER_PROCESS = 128 << 20


def _read(path: str) -> str | None:
    try:
        with open(path) as file:
            return file.read().strip()
    except OSError:
        return None


def _number(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None


def _cgroup_paths(controller: str) -> list[str]:
    """The folders of this process's cgroup for ``controller`` and of each cgroup above it
    (cgroup v2, or the v1 hierarchy of that controller), innermost first."""
    found: list[str] = []
    for line in (_read("/proc/self/cgroup") or "").splitlines():
        number, _, rest = line.partition(":")
        controllers, _, relative = rest.partition(":")
        if number == "0" and not controllers:
            root = "/sys/fs/cgroup"
        elif controller in controllers.split(","):
            root = f"/sys/fs/cgroup/{controller}"
        else:
            continue
        parts = [p for p in relative.split("/") if p]
        found += [os.path.join(root, *parts[:n]) for n in range(len(parts), -1, -1)]
    return found


def free_tasks() -> tuple[int, str] | None:
    """``(how many more tasks may start, the limit that says so)``, the tightest of: the
    cgroup's ``pids.max`` less ``pids.current`` (at every level), ``RLIMIT_NPROC`` less this
    user's tasks (not for root, whom it does not bind), and the kernel's ``pid_max`` and
    ``threads-max`` less every task running. ``None`` when nothing can be read."""
    limits: list[tuple[int, str]] = []
    for folder in _cgroup_paths("pids"):
        most = _number(_read(os.path.join(folder, "pids.max")))
        now = _number(_read(os.path.join(folder, "pids.current")))
        if most is not None and now is not None:
            limits.append(
                (most - now, f"the cgroup's pids.max={most} with {now} running ({folder})")
            )
    loadavg = (_read("/proc/loadavg") or "").split()
    running = _number(loadavg[3].partition("/")[2]) if len(loadavg) > 3 else None
    if running is not None:
        for name in ("pid_max", "threads-max"):
            most = _number(_read(f"/proc/sys/kernel/{name}"))
            if most is not None:
                limits.append(
                    (most - running, f"kernel.{name}={most} with {running} tasks running")
                )
    soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if soft != resource.RLIM_INFINITY and os.getuid() != 0:
        mine = _user_tasks(os.getuid())
        limits.append(
            (soft - mine, f"RLIMIT_NPROC={soft} (ulimit -u) with {mine} of your tasks running")
        )
    return min(limits) if limits else None


def _user_tasks(uid: int) -> int:
    """Tasks (threads) of the processes whose real user is ``uid`` (a scan of /proc)."""
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = dict(
            line.split(":", 1) for line in (_read(f"/proc/{entry}/status") or "").splitlines()
        )
        if fields.get("Uid", "").split()[:1] == [str(uid)]:
            count += _number(fields.get("Threads", "").strip()) or 1
    return count


def free_memory() -> tuple[int, str] | None:
    """``(bytes this job may still take, what says so)``: ``MemAvailable``, or the memory
    cgroup's limit less its usage when that is less. ``None`` when nothing can be read."""
    limits: list[tuple[int, str]] = []
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            limits.append((int(line.split()[1]) << 10, "MemAvailable in /proc/meminfo"))
    for folder in _cgroup_paths("memory"):
        for most_file, now_file in (
            ("memory.max", "memory.current"),
            ("memory.limit_in_bytes", "memory.usage_in_bytes"),
        ):
            most = _number(_read(os.path.join(folder, most_file)))
            now = _number(_read(os.path.join(folder, now_file)))
            if most is not None and now is not None and most < 1 << 60:
                limits.append((most - now, f"the cgroup's {most_file} ({folder})"))
    return min(limits) if limits else None


def check_process_count(count: int, flag: str = "num_processes") -> None:
    """Refuse to start ``count`` processes on this machine when it cannot hold them: each
    takes at least :data:`TASKS_PER_PROCESS` tasks and :data:`MEMORY_PER_PROCESS` bytes
    (floors measured on a CPU rank), against :func:`free_tasks` and :func:`free_memory`.
    Otherwise a start part-way fails (``BlockingIOError`` under a pids limit) or the
    kernel's OOM killer ends a rank. ``flag`` names the flag that set ``count``."""
    short: list[str] = []
    most = count
    tasks = free_tasks()
    if tasks is not None and count * TASKS_PER_PROCESS > tasks[0]:
        most = min(most, max(tasks[0], 0) // TASKS_PER_PROCESS)
        short.append(
            f"each takes at least {TASKS_PER_PROCESS} tasks (threads), "
            f"{count * TASKS_PER_PROCESS} in all, and only {max(tasks[0], 0)} more may start "
            f"({tasks[1]})"
        )
    memory = free_memory()
    if memory is not None and count * MEMORY_PER_PROCESS > memory[0]:
        most = min(most, max(memory[0], 0) // MEMORY_PER_PROCESS)
        short.append(
            f"each takes at least {MEMORY_PER_PROCESS >> 20} MiB before its model (torch "
            f"alone), {count * MEMORY_PER_PROCESS >> 20} MiB in all, and "
            f"{max(memory[0], 0) >> 20} MiB is available ({memory[1]})"
        )
    if short:
        what = f"{flag}={count}" if flag else f"{count} processes per node"
        raise MisconfigurationError(
            f"{what} is more processes than this machine can run: {'; '.join(short)}. Use at "
            f"most {most} processes here (num_nodes spreads a job over machines), or raise "
            "the limit."
        )


def check_sync_batchnorm(flags: Flags, gpu_ids: list[int] | None, backend: str) -> None:
    """``sync_batchnorm=True`` needs GPUs: torch's ``SyncBatchNorm`` refuses CPU tensors in
    training (torch 2.13 with gloo: ``ValueError: SyncBatchNorm expected input tensor to be on
    GPU or XPU or privateuseone``), which would fail inside every rank after the start."""
    if flags.sync_batchnorm and not gpu_ids:
        raise MisconfigurationError(
            f"sync_batchnorm=True with distributed_backend={backend!r} needs GPUs, but no GPU "
            "is selected: the job would train on the CPU, and torch's SyncBatchNorm works only "
            "with GPU tensors. Train on GPUs (set gpus), or drop sync_batchnorm "
            "(sync_batchnorm=False)."
        )


def did_you_mean(name: str, choices: Sequence[str]) -> str:
    """`` Did you mean 'x'?`` or an empty string."""
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""
