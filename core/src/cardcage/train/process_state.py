"""A fit leaves the process that called it as it found it.

While it launches or trains in the calling process, ``fit`` changes that process: the rank
variables of a launched job (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``CARDCAGE_HOSTED_STORE``...), the process group, torch's thread count, cudnn flags, signal
handlers, ``sys.excepthook`` (which torch wraps when it joins a group). Left behind, they
bend the next fit of the process (a notebook, a sweep, a test file): a ``ddp_spawn`` Trainer
made after an in-process ``fsdp`` fit took the leftover ``RANK``/``WORLD_SIZE`` for a
torchelastic job of one process and trained alone. :func:`as_found` takes a snapshot before
the fit and, when it returns or fails, puts back whatever changed, destroys the process
group the fit created, and forgets the job the fit hosted (its rendezvous store, its
supervisor).

What belongs to a job that outlives the fit stays. After a fit that returned in a rank of a
job of several processes (a script whose fit relaunched it as local rank 0 of ``ddp``, a
node of a multi-node job started by hand, a rank torchrun or srun started), the other ranks
run on through the same script, and its later fits join the same processes: the job's
variables, process group (with torch's excepthook) and relaunched processes stay until the
script ends, as they do in every rank. In processes a cluster made the process group is the
job's and stays after a failure too. Everything else is restored there as well. After a
failure elsewhere the job is over: all of it goes. The random state is not restored: a fit
draws from it as a plain training loop would.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from cardcage.backend.launch import relaunch, rendezvous

__all__ = ["Snapshot", "as_found"]

log = logging.getLogger("cardcage")

#: Signals whose handlers cannot be read or changed.
_FIXED = {signal.SIGKILL, signal.SIGSTOP}


def _deterministic() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), (
        torch.is_deterministic_algorithms_warn_only_enabled()
    )


def _set_deterministic(value: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(value[0], warn_only=value[1])


def _anomaly() -> tuple[bool, bool]:
    return torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()


def _set_anomaly(value: tuple[bool, bool]) -> None:
    torch.set_anomaly_enabled(value[0], value[1])


def _set_grad_enabled(value: bool) -> None:
    torch.set_grad_enabled(value)  # a context manager that also sets the mode at once


def _cuda_device() -> int | None:
    """The current CUDA device; ``None`` before CUDA started here (read without starting it)."""
    started = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    return torch.cuda.current_device() if started else None


def _set_cuda_device(device: int | None) -> None:
    torch.cuda.set_device(0 if device is None else device)  # None: CUDA's default, device 0


def _set_default_device(device: Any) -> None:
    # The CPU is torch's default: no device context then (setting "cpu" would add one).
    torch.set_default_device(None if torch.device(device).type == "cpu" else device)


def _attribute(owner: Any, name: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    return (lambda: getattr(owner, name)), (lambda value: setattr(owner, name, value))


def _torch_settings() -> dict[str, tuple[Callable[[], Any], Callable[[Any], None]]]:
    """torch's process-wide settings a fit (or a backend, or the user's hooks) may change:
    name -> (read, write). Reading them creates no CUDA context."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    settings: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {
        "num_threads": (torch.get_num_threads, torch.set_num_threads),
        "default_dtype": (torch.get_default_dtype, torch.set_default_dtype),
        "deterministic_algorithms": (_deterministic, _set_deterministic),
        "float32_matmul_precision": (
            torch.get_float32_matmul_precision,
            torch.set_float32_matmul_precision,
        ),
        "grad_enabled": (torch.is_grad_enabled, _set_grad_enabled),
        "anomaly": (_anomaly, _set_anomaly),
        "cuda.matmul.allow_tf32": _attribute(matmul, "allow_tf32"),
        "cuda.current_device": (_cuda_device, _set_cuda_device),  # set_device of a GPU fit
    }
    for name in ("enabled", "benchmark", "deterministic", "allow_tf32"):
        settings[f"cudnn.{name}"] = _attribute(cudnn, name)
    if hasattr(torch, "get_default_device"):  # torch >= 2.3
        settings["default_device"] = (torch.get_default_device, _set_default_device)
    return settings


def _group_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _group_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if _group_initialized() else 0


def _handlers() -> dict[int, Any]:
    """The Python-level handler of every signal (``None``: not set from Python)."""
    found = {}
    for sig in signal.valid_signals():
        if sig in _FIXED:
            continue
        with contextlib.suppress(ValueError, OSError):
            found[int(sig)] = signal.getsignal(sig)
    return found


@dataclass
class Snapshot:
    """What a fit may change in this process, as it was when :meth:`take` ran."""

    environ: dict[str, str]
    torch: dict[str, Any]
    excepthook: Any
    threading_excepthook: Any
    handlers: dict[int, Any]
    group: bool
    #: Whether this process hosted a rendezvous store (a relaunched job's, still alive).
    hosting: bool
    #: What :meth:`restore` could not put back, and why (logged).
    failed: list[str] = field(default_factory=list)

    @classmethod
    def take(cls) -> Snapshot:
        return cls(
            environ=dict(os.environ),
            torch={name: read() for name, (read, _) in _torch_settings().items()},
            excepthook=sys.excepthook,
            threading_excepthook=threading.excepthook,
            handlers=_handlers(),
            group=_group_initialized(),
            hosting=rendezvous.hosted_store() is not None,
        )

    def restore(self, *, returned: bool, outside: bool) -> None:
        """Put back what changed since :meth:`take`.

        ``returned``: the fit returned (it did not fail); ``outside``: a cluster (or a
        relaunching script) made this process, so its process group is the job's.
        """
        supervisor = relaunch.current_supervisor()
        # This process is a rank of a job of several processes, which run on after the fit.
        job_lives = returned and _group_size() > 1
        ended = supervisor is not None and not job_lives  # its ranks were stopped, or none
        keep_group = job_lives or (outside and not ended)
        if _group_initialized() and not keep_group and (not self.group or ended):
            self._step("the process group", _destroy_group)
        if not keep_group:
            sys.excepthook = self.excepthook  # torch wraps it for the group it joins
        threading.excepthook = self.threading_excepthook
        if not job_lives:
            self._step("the environment", self._restore_environ)
        if ended:  # after the environment: an earlier fit's relaunch set some of it
            self._step("the relaunched job", relaunch.forget)
        if not job_lives and not self.hosting and rendezvous.hosted_store() is not None:
            rendezvous.release_store()  # a launcher that failed before letting go of it
        for name, (read, write) in _torch_settings().items():
            if name in self.torch and read() != self.torch[name]:
                self._step(f"torch's {name}", write, self.torch[name])
        if threading.current_thread() is threading.main_thread():
            for sig, handler in self.handlers.items():
                if handler is not None and signal.getsignal(sig) is not handler:
                    self._step(f"the handler of signal {sig}", signal.signal, sig, handler)
        if self.failed:
            log.warning("cardcage: fit could not restore %s", "; ".join(self.failed))

    def _restore_environ(self) -> None:
        for key in [k for k in os.environ if k not in self.environ]:
            del os.environ[key]
        for key, value in self.environ.items():
            if os.environ.get(key) != value:
                os.environ[key] = value

    def _step(self, what: str, function: Callable[..., Any], *args: Any) -> None:
        try:
            function(*args)
        except Exception as error:  # the fit's own outcome matters more: say it, go on
            self.failed.append(f"{what} ({type(error).__name__}: {error})")


def _destroy_group() -> None:
    import torch.distributed as dist

    dist.destroy_process_group()


@contextlib.contextmanager
def as_found(trainer: Any) -> Iterator[None]:
    """Run ``trainer``'s fit; afterwards (also after a failure) the process is as it was
    before, but for a job that outlives the fit (see the module docstring)."""
    before = Snapshot.take()
    returned = False
    try:
        yield
        returned = True
    finally:
        outside = bool(trainer.selection.processes_created_outside)
        before.restore(returned=returned, outside=outside)
