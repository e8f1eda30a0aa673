"""``cardcage.Trainer``: validates the flags, selects a backend, and dispatches to it.

Resuming from a checkpoint (checked in ``fit``; in each training process, which checkpoint,
its restore, and where the first epoch continues) is in :mod:`cardcage.train.resume`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from cardcage._version import __version__
from cardcage.backend.accelerator import Accelerator
from cardcage.backend.launch.error_files import record_fit_finished
from cardcage.backend.launch.restarts import this_run
from cardcage.backend.launch.watchdog import attach as attach_heart
from cardcage.backend.selection_types import Selection
from cardcage.backend.strategy.step_runner import trained_module
from cardcage.backend.strategy.strategy import Strategy
from cardcage.callbacks import EarlyStopping, ModelCheckpoint
from cardcage.checkpoints import io as checkpoint
from cardcage.checkpoints import validation
from cardcage.checkpoints.validation import OPTIMIZER_TYPES
from cardcage.config.model_contract import Optimization, check_model, configure_optimizers
from cardcage.errors import MisconfigurationError
from cardcage.loggers import resolve as resolve_logger
from cardcage.loggers.base import for_rank, plain
from cardcage.plugins import manager as plugins
from cardcage.selection.engine import select
from cardcage.train import loop, predicting, requeue, stop_step
from cardcage.train import resume as resuming
from cardcage.train.hooks import Hooks, warn_near_misses
from cardcage.train.jobs import apply_process_flags, portable_backend, prepare_launch
from cardcage.train.metrics import MetricStore
from cardcage.train.module import TRAINER_ATTRIBUTE
from cardcage.train.process_state import as_found
from cardcage.train.progress import ProgressBar
from cardcage.train.results import EvaluationResults


class _LoggerNotGiven:
    """``Trainer(logger=...)`` left out: a CSV logger under ``default_root_dir`` when it is
    set, else none. ``logger=True`` passed explicitly writes under the current folder."""

    def __repr__(self) -> str:
        return "True"


_LOGGER_NOT_GIVEN: Any = _LoggerNotGiven()


def _loaders(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


class Trainer:
    """Train a model on the backend the flags and the environment select.

    The flags: ``gpus``, ``tpu_cores``, ``num_processes``, ``num_nodes``,
    ``distributed_backend``, ``auto_select_gpus``, ``log_gpu_memory``, ``sync_batchnorm``,
    ``benchmark``, ``replace_sampler_ddp``, ``precision``, ``max_epochs``, ``max_steps``,
    ``default_root_dir``, ``resume_from_checkpoint``, ``max_restarts``,
    ``checkpoint_every_n_steps``, ``terminate_on_nan`` and ``progress_bar``; the "Flags"
    section of the documentation's "Choosing a backend" page (docs/choosing-a-backend.md)
    gives each one's default and meaning. Every one is checked here: a bad one raises
    :class:`~cardcage.MisconfigurationError` before any process, port or CUDA context
    exists. ``progress_bar``: ``None`` shows a bar on rank 0 when stderr is a terminal;
    ``True``/``False`` force it.

    The loop's flags (``accumulate_grad_batches``, ``gradient_clip_val``,
    ``gradient_clip_algorithm``, ``deterministic``, ``fast_dev_run``, ``limit_*_batches``,
    ``check_val_every_n_epoch``, ``min_epochs``, ``log_every_n_steps``,
    ``num_sanity_val_steps``, ``callbacks``, ``logger``), the hooks it calls and in which
    order, ``self.log``, loggers and callbacks: the documentation's "The training loop" page
    (docs/training-loop.md).
    """

    def __init__(
        self,
        gpus: Any = None,
        tpu_cores: Any = None,
        num_processes: int = 1,
        num_nodes: int = 1,
        distributed_backend: str | None = None,
        auto_select_gpus: bool = False,
        log_gpu_memory: str | None = None,
        sync_batchnorm: bool = False,
        benchmark: bool = False,
        replace_sampler_ddp: bool = True,
        find_unused_parameters: bool | None = None,
        precision: int | str = 32,
        max_epochs: int | None = 1,
        max_steps: int | None = None,
        default_root_dir: str | os.PathLike[str] | None = None,
        resume_from_checkpoint: str | os.PathLike[str] | None = None,
        max_restarts: int = 0,
        checkpoint_every_n_steps: int | None = None,
        terminate_on_nan: bool = False,
        progress_bar: bool | None = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float = 0.0,
        gradient_clip_algorithm: str = "norm",
        deterministic: bool = False,
        fast_dev_run: bool | int = False,
        limit_train_batches: float | int = 1.0,
        limit_val_batches: float | int = 1.0,
        limit_test_batches: float | int = 1.0,
        check_val_every_n_epoch: int = 1,
        min_epochs: int | None = None,
        log_every_n_steps: int = 50,
        num_sanity_val_steps: int = 0,
        callbacks: Any = None,
        logger: Any = _LOGGER_NOT_GIVEN,
        **unknown: Any,
    ):
        # Lightning writes ./lightning_logs for logger=True without default_root_dir; left
        # out, the logger writes only where default_root_dir says (no file otherwise).
        here = os.getcwd() if logger is True else None
        if logger is _LOGGER_NOT_GIVEN:
            logger = True
        # Every check is select's (cardcage.config.flags and the selection engine), so that
        # select and `cardcage explain` refuse exactly what this constructor refuses.
        with plugins.slow_checks_named():  # a slow availability check named while it runs
            self.selection: Selection = select(
                gpus=gpus,
                tpu_cores=tpu_cores,
                num_processes=num_processes,
                num_nodes=num_nodes,
                distributed_backend=distributed_backend,
                auto_select_gpus=auto_select_gpus,
                log_gpu_memory=log_gpu_memory,
                sync_batchnorm=sync_batchnorm,
                benchmark=benchmark,
                replace_sampler_ddp=replace_sampler_ddp,
                find_unused_parameters=find_unused_parameters,
                precision=precision,
                max_epochs=max_epochs,
                max_steps=max_steps,
                default_root_dir=default_root_dir,
                resume_from_checkpoint=resume_from_checkpoint,
                max_restarts=max_restarts,
                checkpoint_every_n_steps=checkpoint_every_n_steps,
                terminate_on_nan=terminate_on_nan,
                progress_bar=progress_bar,
                accumulate_grad_batches=accumulate_grad_batches,
                gradient_clip_val=gradient_clip_val,
                gradient_clip_algorithm=gradient_clip_algorithm,
                deterministic=deterministic,
                fast_dev_run=fast_dev_run,
                limit_train_batches=limit_train_batches,
                limit_val_batches=limit_val_batches,
                limit_test_batches=limit_test_batches,
                check_val_every_n_epoch=check_val_every_n_epoch,
                min_epochs=min_epochs,
                log_every_n_steps=log_every_n_steps,
                num_sanity_val_steps=num_sanity_val_steps,
                callbacks=callbacks,
                logger=logger,
                **unknown,
            )
        self.flags = self.selection.flags
        registry = plugins.registry(os.environ)
        self._registry: plugins.Registry | None = registry
        backend = registry.accelerators[self.selection.accelerator].cls
        self.accelerator: Accelerator = backend(self.selection)
        self.progress_bar_flag = progress_bar
        self.progress = ProgressBar(False)
        self.model: torch.nn.Module = torch.nn.Module()
        self.optimization = Optimization([])
        self.train_dataloader: Any = None
        self.val_dataloaders: list[Any] = []
        self.current_epoch = 0
        self.global_step = 0
        self.batch_idx = 0
        self.epoch_rng: dict[str, Any] | None = None
        self.in_epoch = False  # inside an epoch's batches (a save from training_step)
        self.logged_metrics: dict[str, float] = {}
        #: The callbacks, in the order given (docs/training-loop.md, "Callbacks").
        self.callbacks: list[Any] = (
            []
            if callbacks is None
            else list(callbacks)
            if isinstance(callbacks, (list, tuple))
            else [callbacks]
        )
        for callback in self.callbacks:
            if callable(getattr(callback, "on_keyboard_interrupt", None)):
                raise MisconfigurationError(
                    f"callbacks: {type(callback).__name__} defines on_keyboard_interrupt, "
                    "which cardcage never calls (an interrupted fit stops every rank and "
                    "raises KeyboardInterrupt in the caller). Remove the hook, or catch "
                    "KeyboardInterrupt around trainer.fit."
                )
            init_end = getattr(callback, "on_init_end", None)
            if callable(getattr(callback, "on_init_start", None)):
                callback.on_init_start(self)
            if callable(init_end):
                init_end(self)
        #: The logger flag as given, and where logger=True writes without default_root_dir:
        #: each fit after the first builds its loggers again (a new run, a new version).
        self._logger_flag, self._logger_here = logger, here
        #: The logger (or loggers) global rank 0 writes to; None writes nothing. Ranks other
        #: than 0 hold a :class:`~cardcage.loggers.base.DummyLogger` in its place.
        self.logger: Any = self._new_logger()
        self._fits = 0
        #: What self.log recorded (cardcage.train.metrics); set up again in each training process.
        self.metrics = MetricStore()
        self.hooks = Hooks(self, self.model, self.callbacks)
        #: A request to stop after this epoch, agreed by every rank (docs/training-loop.md).
        self.should_stop = False
        #: Whether validation ran in the current training epoch.
        self.validated_this_epoch = False
        #: The current epoch's batches are done (its validation and end hooks may be running).
        self.epoch_finished = False
        self.losses: list[float] = []
        self._resume: dict[str, Any] | None = None
        #: The step the loop stops at for a requeue (cardcage.train.requeue); never reached: -1.
        self.stop_at_step = stop_step.NEVER
        self._requeue: requeue.RequeueHandler | None = None
        self._prepared = False
        #: What workers handed back (a checkpoint): save_checkpoint writes it in the caller.
        self._handed_back: dict[str, Any] | None = None
        self.results: Any = None
        #: Restarts this fit used (max_restarts); what the next attempt resumes from.
        self.restarts = 0
        self.restart_from: str | None = None
        #: The run the last fit belongs to, as its checkpoints record it
        #: (cardcage.backend.launch.restarts).
        self.run: checkpoint.Run | None = None
        #: resume_from_checkpoint as fit checked it (and read it), for this process's resume.
        self._checked: validation.Checked | None = None

    # -- public API -------------------------------------------------------------------------

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        """The latest value of every metric: logged step values, epoch means, validation
        means (0-dim tensors)."""
        return self.metrics.callback_metrics

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        """The latest values logged with ``prog_bar=True``."""
        return {k: float(v) for k, v in self.metrics.bar_values.items()}

    @property
    def sanity_checking(self) -> bool:
        """Whether the sanity check (``num_sanity_val_steps``) is running."""
        return self.metrics.sanity_checking

    @sanity_checking.setter
    def sanity_checking(self, value: bool) -> None:
        self.metrics.sanity_checking = value

    @property
    def global_rank(self) -> int:
        return self.accelerator.global_rank

    @property
    def world_size(self) -> int:
        return self.accelerator.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.accelerator.global_rank == 0

    @property
    def default_root_dir(self) -> str | None:
        return self.flags.default_root_dir

    @property
    def lightning_module(self) -> torch.nn.Module:
        """The user's model, without a backend's wrapper."""
        return self.accelerator.unwrapped_model(self)

    @property
    def checkpoint_callback(self) -> Any:
        """The first :class:`~cardcage.callbacks.ModelCheckpoint` among the callbacks, or None."""
        return next((c for c in self.callbacks if isinstance(c, ModelCheckpoint)), None)

    @property
    def early_stopping_callback(self) -> Any:
        """The first :class:`~cardcage.callbacks.EarlyStopping` among the callbacks, or None."""
        return next((c for c in self.callbacks if isinstance(c, EarlyStopping)), None)

    def fit(
        self,
        model: torch.nn.Module,
        train_dataloader: Any = None,
        val_dataloaders: Any = None,
    ) -> Any:
        """Train ``model``; afterwards it holds the trained weights of rank 0."""
        check_model(model)
        warn_near_misses(model)
        if train_dataloader is None:
            if not callable(getattr(model, "train_dataloader", None)):
                raise MisconfigurationError(
                    "fit(model) got no train_dataloader and the model has no "
                    "train_dataloader(). Pass fit(model, train_dataloader=...) or add the method."
                )
            train_dataloader = model.train_dataloader()  # type: ignore[operator]
        loop.check_train_dataloader(train_dataloader, self.flags)  # length 0: before any process
        if val_dataloaders is None and callable(getattr(model, "val_dataloader", None)):
            val_dataloaders = model.val_dataloader()  # type: ignore[operator]
        if self._fits:
            self._new_run()
        self._fits += 1
        # Only a restart of this fit resumes from its step checkpoint (restarts.launch sets
        # them); a fit before it that restarted must not hand this one its checkpoint.
        self.restarts, self.restart_from = 0, None
        self.model = model
        self.train_dataloader = train_dataloader
        self.val_dataloaders = _loaders(val_dataloaders)
        self.should_stop = False
        if self.logger is not None:
            # A version picked here, before any rank starts, is the one every copy holds; the
            # process that is (or starts) global rank 0 claims it by making its folder.
            if self.selection.global_rank == 0:
                self.logger.make_log_dir()
            else:
                _ = self.logger.version
        with as_found(self):  # the process as it was, after a fit that returns or fails
            # before any process, port or CUDA context
            self._checked = resuming.check(self, self.accelerator, model)
            # the GPUs, MASTER_ADDR, MASTER_PORT, the process count
            self.selection = prepare_launch(self.selection, self.accelerator)
            hooks = self._hooks()
            # The run its checkpoints record, and which ones a restart may take.
            with this_run(self):
                try:
                    hooks.cardcage_setup(trainer=self, accelerator=self.accelerator)
                    self.results = hooks.cardcage_train(trainer=self, accelerator=self.accelerator)
                finally:
                    self._checked = None  # a backend that never resumed here: let go of it
        return self.results

    def validate(
        self, model: torch.nn.Module | None = None, dataloaders: Any = None
    ) -> EvaluationResults:
        """Run ``validation_step`` over the validation loaders (``model``'s hooks: the model
        passed in, else the one fit trained); return the metrics, one dict per loader."""
        return self._evaluate(model, dataloaders, "validation_step", "val_dataloader", "val")

    def test(
        self, model: torch.nn.Module | None = None, dataloaders: Any = None
    ) -> EvaluationResults:
        """Run ``test_step`` over the test loaders (``model``'s hooks: the model passed in,
        else the one fit trained); return the metrics, one dict per loader."""
        return self._evaluate(model, dataloaders, "test_step", "test_dataloader", "test")

    def predict(self, model: torch.nn.Module | None = None, dataloaders: Any = None) -> list[Any]:
        """``predict_step(batch, batch_idx)``'s outputs (the model's forward without one), in
        the loaders' order; under several processes every sample's prediction once, in order.
        See :mod:`cardcage.train.predicting`."""
        return predicting.predict(self, model, dataloaders)

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Write a checkpoint: one file, atomically (or the backend's own format).

        Call it on every rank: each gathers the state (a sharded backend's collectives), rank
        0 writes, and every rank waits for the checkpoint.
        """
        if self._handed_back is not None:  # the workers trained: write what they handed back
            checkpoint.save_atomic(self.checkpoint_state() or {}, path)
            return
        self.accelerator.save_checkpoint(self, path)

    # -- what backends and the loop call ----------------------------------------------------

    def prepare(self) -> None:
        """Set up this training process: the backend's per-process setup, the optimizers,
        the resume state.

        Runs the ``cardcage_setup_process`` hook (whose default implementation calls the
        backend's ``setup_process``), so plugins may wrap it.
        """
        # Before setup (which may wait for every rank): a requeue signal from now on counts.
        self._requeue = requeue.handler_for(self)
        self._handed_back = None  # this process trains: its own state is the one to save
        self._hooks().cardcage_setup_process(trainer=self, accelerator=self.accelerator)
        self._prepared = True
        self.start_metrics()
        self.hooks("setup", "fit")  # Lightning 1.0: before configure_optimizers
        self.optimization = configure_optimizers(self.model)
        self.accelerator.setup_optimizers(self)
        self.progress = ProgressBar(
            ProgressBar.wanted(self.progress_bar_flag, self.accelerator.global_rank)
        )
        checked, self._checked = self._checked, None  # what fit read: not read a second time
        state = resuming.resume(self, self.accelerator, self._requeue, checked)
        if state is not None:
            self._resume = state
        if self._requeue is not None:
            self._requeue.start(self)

    def start_metrics(self) -> None:
        """This process's metric store and hooks, once the backend placed the model."""
        accelerator = self.accelerator
        self.metrics = MetricStore(
            reduce=accelerator.reduce, world_size=accelerator.world_size, strategy=accelerator
        )
        self.hooks = Hooks(self, self.model, self.callbacks)
        # Only rank 0 writes the run's files: the other ranks' trainer.logger writes nothing
        # (a user's self.trainer.logger.experiment.add_image on every rank made one
        # TensorBoard events file per rank).
        if self.logger is not None and accelerator.world_size > 1:
            # Rank 0 claimed the run's version; a rank started apart (relaunch, torchrun)
            # picked the next free one: it goes on with rank 0's instead.
            state = accelerator.broadcast(self.logger.run_state())
            if accelerator.global_rank != 0 and state is not None:
                self.logger.continue_run(state)
        self.logger = for_rank(self.logger, accelerator.global_rank)
        self.model.__dict__[TRAINER_ATTRIBUTE] = self  # the model's self.log, self.trainer
        user = accelerator.unwrapped_model(self)
        if user is not self.model:
            user.__dict__[TRAINER_ATTRIBUTE] = self

    def callback_states(self) -> dict[str, Any]:
        """Each callback's ``on_save_checkpoint`` state, under its ``state_key`` (``#i``
        added for a repeated key)."""
        states: dict[str, Any] = {}
        for key, callback in self._keyed_callbacks():
            save = getattr(callback, "on_save_checkpoint", None)
            state = save(self, self.lightning_module) if callable(save) else None
            if state is not None:
                states[key] = state
        return states

    def load_callback_states(self, states: dict[str, Any] | None) -> None:
        """Give each callback its state from a checkpoint (``on_load_checkpoint``)."""
        for key, callback in self._keyed_callbacks():
            load = getattr(callback, "on_load_checkpoint", None)
            if states and key in states and callable(load):
                load(states[key])

    def _keyed_callbacks(self) -> list[tuple[str, Any]]:
        seen: dict[str, int] = {}
        keyed = []
        for callback in self.callbacks:
            key = getattr(callback, "state_key", None) or type(callback).__qualname__
            count = seen.get(key, 0)
            seen[key] = count + 1
            keyed.append((key if not count else f"{key}#{count}", callback))
        return keyed

    def run_fit_loop(self) -> Any:
        """Train in this process: set it up, run the loop, tear it down (also after a
        failure). Launchers call it once in every training process."""
        hooks = self._hooks()
        apply_process_flags(self.flags)
        heart = attach_heart()  # before setup: a rank stuck there shows its pid and stack
        try:
            self.prepare()
            loop.fit_loop(self, self.accelerator, heart)
        except BaseException as error:
            # A fit that ends early ends its logger's run too (its files closed and flushed),
            # as one that ends well does with "success"; the error is what propagates.
            stopped = isinstance(error, KeyboardInterrupt | SystemExit)  # SystemExit: a requeue
            self._finalize_logger("interrupted" if stopped else "failed")
            raise
        finally:
            if self._requeue is not None:
                self._requeue.close()
                self._requeue = None
            self.in_epoch = False
            self.progress.end_epoch()
            for model in (self.model, self.accelerator.unwrapped_model(self)):
                model.__dict__.pop(TRAINER_ATTRIBUTE, None)
            try:
                hooks.cardcage_teardown_process(trainer=self, accelerator=self.accelerator)
            finally:
                if heart is not None:
                    heart.close()
        record_fit_finished()  # a rank that exits without this has left the job early
        return None

    def _finalize_logger(self, status: str) -> None:
        logger = self.logger
        if logger is None or not self._prepared or not self.is_global_zero:
            return
        try:
            logger.finalize(status)
        except Exception as error:  # the fit's own error is the one to report
            warnings.warn(
                f"cardcage: {type(logger).__name__}.finalize({status!r}) failed: {error!r}",
                UserWarning,
                stacklevel=2,
            )

    def at_stop_step(self) -> None:
        """The loop reached ``stop_at_step``: checkpoint and requeue (raises), or go on."""
        if self._requeue is not None:
            self._requeue.at_stop_step(self)

    def resume_position(self) -> tuple[int, dict[str, Any] | None, bool]:
        """Where a resumed run continues inside its first epoch.

        Returns the number of batches to skip, the random state to take after them (``None``
        when the run resumes at an epoch boundary), and whether to take it after drawing the
        next batch (the checkpoint was written from inside ``training_step``, once its batch
        had been drawn) rather than before.
        """
        state, self._resume = self._resume, None
        return resuming.position(self, state)

    def record_losses(self, losses: list[torch.Tensor]) -> None:
        """Keep an epoch's step losses, given as 1-D chunks (one transfer per epoch)."""
        if losses:
            values = torch.cat(losses).double().cpu().tolist()  # exact at every precision
            self.losses.extend(values)
            self.logged_metrics["loss"] = values[-1]
        self.logged_metrics["epoch"] = float(self.current_epoch)

    def checkpoint_state(self) -> dict[str, Any] | None:
        """Everything a resumed run needs, as plain tensors and containers.

        Collective-safe: call it on every rank at the same point. The backend's
        ``gather_state`` supplies the model and optimizers (a sharded backend gathers them);
        ranks that hold no full copy get ``None``. In a process that did not train (the
        caller of a spawned run) it is the state the workers handed back, with the model's
        current weights.
        """
        if self._handed_back is not None:
            return {**self._handed_back, "state_dict": self.model.state_dict()}
        gathered = self.accelerator.gather_state(self)
        if gathered is None:
            return None
        return self.accelerator.portable({**self.loop_state(), **gathered})

    def loop_state(self) -> dict[str, Any]:
        """What a checkpoint holds besides the model and the optimizers (which the backend's
        ``gather_state`` supplies): the format, the schedulers, the grad scaler, the loop's
        position and the random states."""
        finished = self.epoch_finished  # the epoch's batches are done: resume at the next
        return {
            "format": validation.FORMAT,
            "cardcage_version": __version__,
            # what the resume check compares configure_optimizers() with, in the caller
            OPTIMIZER_TYPES: [type(o).__name__ for o in self.optimization.optimizers],
            "schedulers": [s.state_dict() for s in self.optimization.schedulers],
            "scaler": self.accelerator.precision.state_dict(),
            "epoch": self.current_epoch + 1 if finished else self.current_epoch,
            "global_step": self.global_step,
            "batch_idx": 0 if finished else self.batch_idx,
            "rng": checkpoint.rng_state(),
            "epoch_rng": self.epoch_rng
            if not finished and (self.batch_idx or self.in_epoch)
            else None,
            "rng_after_fetch": self.in_epoch,
            "run": self.run.record() if self.run is not None else None,
            "callbacks": self.callback_states(),
        }

    # -- moving between processes (ddp_spawn) -----------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_registry"] = None  # pluggy's manager stays behind; attach() reloads it
        state["_requeue"] = None  # threads and a signal handler belong to one process
        state["_handed_back"] = None  # workers train, and so hold their own state
        # Workers read the checkpoint themselves; this process will not: let go of it.
        state["_checked"] = self._checked = None
        state["progress"] = ProgressBar(False)
        state["metrics"] = MetricStore()  # each worker starts its own (start_metrics)
        state["hooks"] = None
        state["caller_rng"] = checkpoint.rng_state()  # workers draw as the script would
        state["selection"], state["accelerator"] = portable_backend(
            self.selection, self.accelerator
        )
        return state

    def _new_run(self) -> None:
        """A second ``fit`` is a new run, as a new Trainer's would be: the counters from 0,
        no state of the last run to resume or hand back, and the loggers built again (the
        next free version; a logger object passed in is kept, with its own version)."""
        self.current_epoch = self.global_step = self.batch_idx = 0
        self.epoch_rng = self._resume = self._handed_back = self.run = None
        self.losses, self.logged_metrics = [], {}
        self.logger = self._new_logger()

    def _new_logger(self) -> Any:
        if self.flags.fast_dev_run:
            return None
        registry = self._registry or plugins.registry(os.environ)
        return resolve_logger(
            self._logger_flag, self.flags.default_root_dir, registry, self._logger_here
        )

    def _hooks(self) -> Any:
        self.attach()
        assert self._registry is not None
        return self._registry.hooks

    def pickled_parts(self) -> dict[str, Any]:
        """The parts of the job a worker launcher pickles (for its message when one cannot be)."""
        parts = {"model": self.model, "train_dataloader": self.train_dataloader}
        parts.update({f"val_dataloaders[{i}]": v for i, v in enumerate(self.val_dataloaders)})
        return parts

    def attach(self) -> None:
        """Reconnect a trainer that arrived in a new process to this process's plugins."""
        if self._registry is None:
            self._registry = plugins.registry(os.environ)

    def export_results(self) -> dict[str, Any] | None:
        """What a worker hands back to the launching process: the whole training state (a
        checkpoint), the logged metrics and the losses. Collective-safe, like
        :meth:`checkpoint_state`; ``None`` on ranks that hold no full copy."""
        state = self.checkpoint_state()
        if state is None:
            return None
        logger = self.logger
        # Rank 0's logger wrote the run's files: the caller's copy goes on with them (a
        # test() after fit adds its rows to the fit's metrics.csv, in the same version).
        handed = logger.run_state() if logger is not None and self.is_global_zero else None
        return {
            "checkpoint": state,
            "logged_metrics": dict(self.logged_metrics),
            "callback_metrics": {k: float(v) for k, v in self.callback_metrics.items()},
            "losses": list(self.losses),
            "logger": handed if plain(handed) else None,
        }

    def apply_results(self, result: dict[str, Any]) -> None:
        """Take what a worker exported: the weights into the user's model, the counters and
        metrics, and the rest of the state for a later ``save_checkpoint`` here."""
        state = dict(result["checkpoint"])
        self.model.load_state_dict(state.pop("state_dict"))
        self.logged_metrics = dict(result["logged_metrics"])
        self.metrics.callback_metrics.update(
            {k: torch.tensor(v) for k, v in result.get("callback_metrics", {}).items()}
        )
        self.load_callback_states(state.get("callbacks"))
        if result.get("logger") is not None and self.logger is not None:
            self.logger.continue_run(result["logger"])
        self.losses = list(result["losses"])
        self.global_step = int(state["global_step"])
        self.current_epoch = int(state["epoch"])
        self.batch_idx = int(state["batch_idx"])
        self._handed_back = state

    # -- internals --------------------------------------------------------------------------

    def _evaluate(
        self,
        model: torch.nn.Module | None,
        dataloaders: Any,
        step: str,
        source: str,
        prefix: str,
    ) -> EvaluationResults:
        if model is not None:
            check_model(model, needs=step)
            self.model = model
        if not callable(getattr(self.model, step, None)):
            raise MisconfigurationError(
                f"{prefix}: the model has no {step}(batch, batch_idx). Add it to evaluate."
            )
        if dataloaders is None and callable(getattr(self.model, source, None)):
            dataloaders = getattr(self.model, source)()
        loaders = _loaders(dataloaders)
        if not loaders:
            raise MisconfigurationError(
                f"{prefix}: no dataloader. Pass dataloaders=... or add {source}() to the model."
            )
        with self.evaluating() as strategy:
            combined, per_loader = loop.evaluate_loaders(self, strategy, loaders, step, prefix)
        return EvaluationResults(per_loader, combined)

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[Strategy]:
        """Where ``validate``, ``test`` and ``predict`` run in this process, with
        ``trainer.model`` (the model passed in, else the one fit trained) bound to this
        Trainer while they run: its hooks are the ones called, its ``self.log`` recorded.

        In a process that is one rank of a running job (it trained, or the job's processes
        were made outside: torchrun, SLURM, horovodrun), that job's backend, set up here
        if it was not (a model other than the one it set up is moved to its device and run
        as it is, outside the backend's wrapper of the trained one). Otherwise (workers that
        trained are gone, or ``fit`` would start the processes and has not) this process
        evaluates the whole data alone, on the CPU, with the weights it holds: no process is
        started for an evaluation. What fit recorded (``callback_metrics``, the logger's
        run) is kept: the evaluation's values are added to it.
        """
        kept = self.metrics.callback_metrics
        selection = self.selection
        joins = self._prepared or selection.world_size <= 1
        joins = joins or (selection.processes_created_outside and self._handed_back is None)
        strategy: Strategy
        if not joins or self._handed_back is not None:
            strategy = Strategy(dataclasses.replace(selection, world_size=1, global_rank=0))
            strategy.setup_process(self)
        else:
            strategy = self.accelerator
            if not self._prepared:
                self._hooks().cardcage_setup_process(trainer=self, accelerator=strategy)
                self._prepared = True
                self.start_metrics()
            elif self._foreign(strategy):
                self.model.to(strategy.device)
                if strategy.precision.dtype is not None:
                    self.model.to(strategy.precision.dtype)
        self.metrics = MetricStore(
            reduce=strategy.reduce,
            world_size=strategy.world_size,
            strategy=strategy,
            callback_metrics=kept,
        )
        self.hooks = Hooks(self, self.model, self.callbacks)
        models = {id(m): m for m in (self.model, strategy.unwrapped_model(self))}.values()
        bound = [m for m in models if m.__dict__.get(TRAINER_ATTRIBUTE) is not self]
        for bound_model in bound:
            bound_model.__dict__[TRAINER_ATTRIBUTE] = self  # self.log, self.trainer
        try:
            yield strategy
        finally:
            for bound_model in bound:
                bound_model.__dict__.pop(TRAINER_ATTRIBUTE, None)

    def _foreign(self, strategy: Strategy) -> bool:
        """Whether ``trainer.model`` is another model than the one ``strategy`` set up and
        runs its steps through (a wrapper of it, or a sharded copy)."""
        parallel = strategy.parallel
        return parallel is not None and trained_module(parallel) is not self.model

    def evaluation_step_function(self, strategy: Strategy, name: str) -> Any:
        """The function that runs ``trainer.model.<name>`` for an evaluation: the backend's,
        or the model's own method for a model the backend did not set up (its wrapper runs
        the trained model)."""
        if self._foreign(strategy):
            return getattr(self.model, name)
        return strategy.step_function(self.model, name)
