"""Workers that receive the pickled trainer and hand the trained state back.

:class:`WorkerLauncher` is the one worker launcher of the core. In the calling process it
pickles the trainer (naming the part of the job that cannot be pickled, before anything
starts), has its subclass start N workers that each call :func:`run_worker`, and takes back
what each node's local rank 0 left: the model's weights, the optimizers, schedulers, scaler
and loop position (a whole checkpoint, so that ``save_checkpoint`` after ``fit`` in the
caller writes the full state), the logged metrics and losses. Subclasses only say how N
workers start: :class:`SpawnLauncher` (``torch.multiprocessing``'s spawn context, supervised
here), horovod's (``horovod.run``) and tpu's (``xmp.spawn``).

A worker leaves through :func:`leave`: results flushed, the process group destroyed, then
``os._exit``, skipping the interpreter's teardown, where torch's C++ threads that are still
joinable abort the process now and then ("terminate called without an active exception").
"""

from __future__ import annotations

import abc
import contextlib
import importlib
import importlib.machinery
import os
import pickle
import shutil
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

import torch

from cardcage.backend.launch import tempdirs
from cardcage.backend.launch.error_files import ERROR_FILE, first_recorded, write_error_file
from cardcage.backend.launch.launcher import Launcher
from cardcage.backend.launch.rendezvous import (
    DEFAULT_ADDRESS,
    HOSTED_STORE,
    host_store,
    hosted_store,
    meeting_address,
    release_store,
)
from cardcage.backend.launch.supervisor import (
    Child,
    Supervisor,
    set_parent_death_signal,
    stop_processes,
)
from cardcage.backend.launch.watchdog import HEARTBEAT, Watch
from cardcage.checkpoints.io import set_rng_state
from cardcage.environments import inherited
from cardcage.errors import MisconfigurationError, RankFailedError

if TYPE_CHECKING:
    from cardcage.backend.trainer_protocol import TrainerProtocol as Trainer

#: The file each node's local rank 0 leaves its results in, inside the launcher's folder.
RESULTS = "results.pt"
#: The pickled trainer, for workers that read it from the launcher's folder.
JOB = "job.pickle"
FOLDER_PREFIX = (
    "cardcage-workers-"  #: + <pid>.<start>@<host>-<random> (cardcage.backend.launch.tempdirs)
)


class WorkerLauncher(Launcher):
    """Pickle the trainer, start the workers (the subclass's part), take the results back."""

    #: What else the user can do when the job cannot be pickled (ends the error message).
    unpicklable_hint = "or use distributed_backend='ddp', which re-runs your script instead"
    #: Workers are this process's to start again (``max_restarts``).
    restartable: ClassVar[bool] = True
    #: Whether the workers import the caller's script. When they do not (``horovod.run``'s
    #: workers), set this: the trainer is then pickled by cloudpickle (which must be
    #: installed), with the classes of ``__main__`` and of every module the workers could
    #: not import by name (:func:`modules_by_value`) carried by value.
    pickle_by_value: ClassVar[bool] = False

    def launch(self, trainer: Trainer) -> Any:
        payload = self.pickle(trainer)
        folder = tempdirs.make(FOLDER_PREFIX)  # private; a killed launcher's are removed
        # A runner (horovod.run, say) may install SIGINT/SIGTERM handlers of its own to stop
        # its workers; they must not outlive the run.
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.start_workers(payload, folder)
            results = torch.load(folder / RESULTS, weights_only=True)
        except RankFailedError:
            raise
        except Exception as error:
            # A runner that reports a failed worker its own way: name the first failing
            # rank with its traceback, when a worker recorded one.
            recorded = first_recorded(folder)
            if recorded is None:
                raise
            raise RankFailedError(recorded[0], self.exit_code(error), recorded[1]) from None
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            shutil.rmtree(folder, ignore_errors=True)  # fit leaves no file behind
        trainer.apply_results(results)
        return None

    @abc.abstractmethod
    def start_workers(self, payload: bytes, folder: Path) -> None:
        """Start this node's workers, each calling :func:`run_worker` (``payload``,
        ``folder``), and return once all of them finished; raise
        :class:`~cardcage.errors.RankFailedError` naming the first that failed.

        Workers write their error files as ``folder/rank-<R>.txt``
        (:data:`~cardcage.backend.launch.error_files.ERROR_FILE`).
        """

    def pickle(self, trainer: Trainer) -> bytes:
        """The trainer as bytes for the workers (plain pickle, or cloudpickle with
        :attr:`pickle_by_value`; both copy tensors)."""
        setting, hint = self.describe(trainer), self.unpicklable_hint
        if not self.pickle_by_value:
            return pickle_job(trainer, pickle.dumps, setting, hint)
        cloudpickle = importlib.import_module("cloudpickle")
        by_value = modules_by_value(trainer)
        for module in by_value:
            cloudpickle.register_pickle_by_value(module)
        try:
            return pickle_job(trainer, cloudpickle.dumps, setting, hint)
        finally:
            for module in by_value:
                cloudpickle.unregister_pickle_by_value(module)

    def exit_code(self, error: Exception) -> int:
        """The exit status of the failed worker that ``error`` (raised by the runner of
        :meth:`start_workers`) reports; 1 when it does not say."""
        return 1

    def describe(self, trainer: Trainer) -> str:
        """The setting that sends the job to workers, for error messages: the backend, and
        ``num_processes`` when it asks for several."""
        setting = f"distributed_backend={self.accelerator.selection.accelerator!r}"
        processes = trainer.flags.num_processes
        return f"{setting} with num_processes={processes}" if processes > 1 else setting


def pickle_job(trainer: Trainer, dumps: Callable[[Any], bytes], setting: str, hint: str) -> bytes:
    """``dumps(trainer)``; when that fails, a MisconfigurationError naming the part of the
    job (the model, a dataloader) that cannot be pickled.

    Plain pickle copies tensors; torch.multiprocessing's pickler would instead share their
    memory between the workers, so that every rank's optimizer step would land on the same
    weights.
    """
    try:
        return dumps(trainer)
    except Exception:
        for label, value in trainer.pickled_parts().items():
            try:
                dumps(value)
            except Exception as error:
                raise MisconfigurationError(
                    f"{setting} sends the {label} to its worker processes by pickling, but it "
                    f"cannot be pickled ({type(error).__name__}: {error}). Make it picklable "
                    f"(no lambdas or local classes), {hint}."
                ) from None
        raise


def modules_by_value(trainer: Trainer) -> list[ModuleType]:
    """Modules of the job's parts (the model's, the loaders' and the datasets' classes; a
    Cage's function) that a worker which does not run the caller's script could not import
    by name (loaded from a file path, or
    from a folder only the caller has on its path). ``__main__`` is not listed: cloudpickle
    always carries it by value."""
    parts = list(trainer.pickled_parts().values())
    objects = [*parts, *(getattr(part, "dataset", None) for part in parts)]
    found: list[ModuleType] = []
    for obj in objects:
        # a function's own module (a Cage's fn), else the module of the object's class
        name = obj.__module__ if callable(obj) and hasattr(obj, "__code__") else None
        module = sys.modules.get(name or type(obj).__module__)
        if module is None or module.__name__ == "__main__" or module in found:
            continue
        top = module.__name__.partition(".")[0]
        if top in sys.builtin_module_names:
            continue
        if importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path]) is None:
            found.append(module)
    return found


def run_worker(
    payload: bytes,
    folder: str | os.PathLike[str],
    before_fit: Callable[[Trainer], None] | None = None,
    *,
    failure_rank: Callable[[], int] | None = None,
) -> Trainer:
    """In a worker: unpickle the trainer, train, and hand the state back.

    Every rank gathers the results (a sharded backend runs its collectives there); each
    node's local rank 0 writes them to ``folder/results.pt``. With ``failure_rank`` (a
    function that returns this worker's global rank), a failure is reported at once, before
    it propagates: its traceback goes to ``folder/rank-<R>.txt`` and to stderr. For workers
    that are threads (one ``CARDCAGE_ERROR_FILE`` would serve them all), or whose peers wait
    for them in a collective while the engine may end the process before the error surfaces.
    """
    try:
        return _train_worker(payload, Path(folder), before_fit)
    except BaseException as error:
        if failure_rank is None:
            raise
        write_error_file(error, Path(folder) / f"rank-{failure_rank()}.txt")
        traceback.print_exception(type(error), error, error.__traceback__)
        sys.stderr.flush()
        raise


def _train_worker(
    payload: bytes, folder: Path, before_fit: Callable[[Trainer], None] | None
) -> Trainer:
    """:func:`run_worker`'s work: the trainer, its training, and local rank 0's results."""
    trainer: Trainer = pickle.loads(payload)
    # Every rank starts from the random state the caller had at fit, as every rank of a
    # relaunched script does: dropout and shuffles are reproducible, and a restart exact.
    caller_rng = trainer.__dict__.pop("caller_rng", None)
    if caller_rng is not None:
        set_rng_state(caller_rng)
    trainer.attach()
    if before_fit is not None:
        before_fit(trainer)
    trainer.run_fit_loop()
    results = trainer.export_results()
    if trainer.accelerator.hands_back_results:
        if results is None:
            raise RuntimeError(
                f"{type(trainer.accelerator).__name__}.gather_state returned None on local "
                "rank 0, which hands the results back: return the full state there"
            )
        path = folder / RESULTS
        with open(path.with_suffix(".tmp"), "wb") as stream:
            torch.save(results, stream)
        os.replace(path.with_suffix(".tmp"), path)
    return trainer


def run_started_worker(payload: bytes, folder: str, path: list[str], rank_variable: str) -> None:
    """A worker that a runner outside cardcage started (``horovod.run``): the caller's
    import ``path``, an error file for the rank that ``rank_variable`` names, then
    :func:`run_worker`. It returns to the runner; a failure leaves at once (:func:`fail`):
    the other ranks may be stuck in a collective with this one, and a normal interpreter
    exit would wait for the runner's shutdown with them."""
    sys.path.extend(entry for entry in path if entry not in sys.path)
    os.environ[ERROR_FILE] = str(Path(folder) / f"rank-{os.environ.get(rank_variable, '0')}.txt")
    try:
        run_worker(payload, folder)
    except BaseException as error:
        fail(error)


def leave(code: int, *, destroy: bool = True) -> NoReturn:
    """End a worker: flush its streams, destroy the process group, ``os._exit(code)``."""
    if destroy:
        with contextlib.suppress(Exception):
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def fail(error: BaseException) -> NoReturn:
    """A worker's failure: its traceback to the error file and stderr, then exit 1 at once.

    The other ranks may be stuck in a collective with this one, so the process group is
    not destroyed: the launcher stops them.
    """
    write_error_file(error)
    traceback.print_exception(type(error), error, error.__traceback__)
    leave(1, destroy=False)


# -- torch.multiprocessing's spawn (ddp_spawn) --------------------------------------------------


class SpawnLauncher(WorkerLauncher):
    """``num_processes`` workers per node from the spawn start method, supervised here."""

    def start_workers(self, payload: bytes, folder: Path) -> None:
        import multiprocessing
        import multiprocessing.connection

        selection = self.accelerator.selection
        nprocs, num_nodes, node_rank = (
            selection.num_processes,
            selection.num_nodes,
            selection.node_rank,
        )
        world_size = nprocs * num_nodes
        master_port = selection.master_port
        address = selection.master_address or DEFAULT_ADDRESS
        hosted = master_port is None
        if hosted:
            if num_nodes > 1:
                raise MisconfigurationError(
                    f"num_nodes={num_nodes} launched by hand needs MASTER_PORT (and MASTER_ADDR) "
                    "set to the same values on every node."
                )
            # where the ranks dial MASTER_ADDR: a loopback address (rendezvous.meeting_address)
            address = meeting_address(address)
            master_port = int(host_store(world_size, address).port)
        context = multiprocessing.get_context("spawn")
        # The job goes by file, not through the Process arguments: those are written to the
        # child's pipe, which blocks start() until the child has imported torch and read
        # them, so that the workers would start one after the other (measured: +1.3 s).
        job = folder / JOB
        job.write_bytes(payload)
        # Made before the workers start: a worker's loop finds its count there.
        watch = Watch(folder, world_size) if hosted else None
        children: list[Child] = []
        processes: list[Any] = []
        for local_rank in range(nprocs):
            rank = node_rank * nprocs + local_rank
            rank_env = {
                "MASTER_ADDR": address,
                "MASTER_PORT": str(master_port),
                "WORLD_SIZE": str(world_size),
                "RANK": str(rank),
                "LOCAL_RANK": str(local_rank),
                "NODE_RANK": str(node_rank),
                "GROUP_RANK": str(node_rank),
                "LOCAL_WORLD_SIZE": str(nprocs),
                ERROR_FILE: str(folder / f"rank-{rank}.txt"),
            }
            if hosted:
                rank_env[HOSTED_STORE] = "1"
                rank_env[HEARTBEAT] = str(folder)  # this process watches their progress
            process = context.Process(
                target=_spawned,
                args=(rank_env, str(job), str(folder)),
                name=f"cardcage-rank-{rank}",
            )
            _start(process, processes, rank, nprocs)
            children.append(
                Child(rank, process.pid or 0, _exitcode(process), folder / f"rank-{rank}.txt")
            )
        supervisor = Supervisor(
            children,
            store=hosted_store() if hosted else None,
            world_size=world_size if hosted else 0,
            watch=watch,
        )

        def wait() -> None:
            # Blocks until a worker exits: this process takes no CPU from the workers while
            # they train (polling every 20 ms cost it 0.5% of a core). The timeout only
            # bounds how long the watcher's interrupt waits to be taken here; the watcher
            # stops the workers before it interrupts, which ends the wait at once anyway.
            running = list(processes)
            while running:
                ended = multiprocessing.connection.wait([p.sentinel for p in running], 1.0)
                running = [p for p in running if p.sentinel not in ended]

        try:
            supervisor.run(wait)
            # Workers that failed while this process was leaving the wait are failures too
            # (the watcher may have recorded one already).
            failed = supervisor.failure or supervisor.first_failure()
            if failed is not None:
                raise failed.error()
        finally:
            release_store()


def _start(process: Any, started: list[Any], rank: int, nprocs: int) -> None:
    """Start rank ``rank``'s worker. When it cannot (a limit on processes or open files),
    those ``started`` already are stopped at once rather than left waiting for it."""
    try:
        process.start()
    except BaseException as error:
        stop_processes([p.pid for p in started], [_exitcode(p) for p in started])
        release_store()
        if not isinstance(error, Exception):
            raise  # Ctrl+C while starting them: no worker is left either
        reason = f"could not be started ({type(error).__name__}: {error}) after {len(started)}"
        reason += f" of {nprocs} worker(s) had been"
        if isinstance(error, OSError):
            reason += " (a limit on processes or open files? lower num_processes or raise it)"
        raise RankFailedError(rank, None, reason=reason) from error
    started.append(process)


def _exitcode(process: Any) -> Callable[[], int | None]:
    return lambda: process.exitcode  # its exit status once it ended (and reaped), or None


def _spawned(rank_env: dict[str, str], job: str, folder: str) -> NoReturn:
    """A spawned worker: its rank variables, death with the launcher, training, exit."""
    set_parent_death_signal()
    os.environ.update(rank_env)
    inherited.mark()  # these rank variables are this process's (not the launcher's child's)
    try:
        run_worker(Path(job).read_bytes(), folder)
    except BaseException as error:
        fail(error)
    leave(0)
