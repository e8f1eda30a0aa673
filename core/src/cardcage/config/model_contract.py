"""The model contract: what cardcage asks of a ``torch.nn.Module`` and how it reads the answers.

A model has ``training_step(batch, batch_idx)`` returning a loss tensor or a dict holding
``"loss"``, and ``configure_optimizers()`` returning an optimizer, a list of them, a pair
``(optimizers, schedulers)``, a dict with ``"optimizer"`` and ``"lr_scheduler"``, or a list
of such dicts; a scheduler is an object or a dict ``{"scheduler", "interval": "epoch"|"step",
"frequency", "monitor", "strict"}`` (:class:`SchedulerConfig`).
``train_dataloader()``, ``val_dataloader()``, ``test_dataloader()``, ``validation_step`` and
``test_step`` are optional, and so is ``on_after_backward()``: called after every backward and
before the optimizer step, with the gradients the optimizer will use (averaged across
processes, and unscaled at precision 16), it is where gradients are clipped or inspected.
With several optimizers, a ``training_step`` that accepts ``optimizer_idx`` is called once
per optimizer; otherwise it is called once and every optimizer steps.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from cardcage.errors import MisconfigurationError

SCHEDULER_KEYS = ("scheduler", "interval", "frequency", "monitor", "strict")
OPTIMIZER_KEYS = ("optimizer", "lr_scheduler", "monitor")


@dataclass
class SchedulerConfig:
    """How the loop drives one learning-rate scheduler (Lightning 1.0's scheduler dict).

    ``interval="step"``: stepped after every ``frequency``-th optimizer step, counted over the
    whole run; ``"epoch"``: after every ``frequency``-th epoch (``(epoch + 1) % frequency``),
    after that epoch's validation. A scheduler with a ``monitor`` (``ReduceLROnPlateau``) is
    stepped with that metric's latest value; a missing metric raises with ``strict``, else
    warns once and the step is skipped.
    """

    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None
    strict: bool = True
    warned: bool = field(default=False, compare=False)


@dataclass
class Optimization:
    """The optimizers and learning-rate schedulers a model asked for."""

    optimizers: list[torch.optim.Optimizer]
    schedulers: list[Any] = field(default_factory=list)
    per_optimizer_steps: bool = False  # training_step takes optimizer_idx
    #: How each of ``schedulers`` is stepped, in the same order (default: every epoch).
    configs: list[SchedulerConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.configs) != len(self.schedulers):
            self.configs = [SchedulerConfig(s) for s in self.schedulers]

    def step_configs(self) -> list[SchedulerConfig]:
        """The schedulers stepped after optimizer steps."""
        return [c for c in self.configs if c.interval == "step"]

    def epoch_configs(self) -> list[SchedulerConfig]:
        """The schedulers stepped at the end of an epoch."""
        return [c for c in self.configs if c.interval == "epoch"]

    def wrap(
        self, wrap: Callable[[torch.optim.Optimizer], torch.optim.Optimizer]
    ) -> list[torch.optim.Optimizer]:
        """Replace every optimizer with ``wrap(optimizer)`` and return the wrappers.

        For a backend whose optimizer wrapper (Horovod's ``DistributedOptimizer``) is a new
        object: each learning-rate scheduler moves to its optimizer's wrapper, which keeps it
        driving the learning rates after a state is loaded into the wrapper (a resume replaces
        the parameter-group dicts the two shared), and the wrapper's steps are marked the way
        a scheduler marks its optimizer's, so that torch's "scheduler stepped before the
        optimizer" check holds.
        """
        wrapped = {id(optimizer): wrap(optimizer) for optimizer in self.optimizers}
        for scheduler in self.schedulers:
            target = wrapped.get(id(getattr(scheduler, "optimizer", None)))
            if target is not None:
                scheduler.optimizer = target
                _mark_steps(target)
        self.optimizers = list(wrapped.values())
        return list(self.optimizers)

    def scale_learning_rates(self, factor: float) -> None:
        """Multiply every learning rate by ``factor``: each parameter group's ``lr`` (and
        ``initial_lr``, which schedulers start from) and the schedulers' ``base_lrs``."""
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * factor
                if "initial_lr" in group:
                    group["initial_lr"] = group["initial_lr"] * factor
        for scheduler in self.schedulers:
            if getattr(scheduler, "base_lrs", None) is not None:
                scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]


def named_parameters(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` for every parameter ``optimizer`` holds, named as ``model``
    names it (``unnamed.<i>`` for one the model does not hold), in the model's order.

    For optimizer wrappers that key each gradient's collective by its parameter's name
    (Horovod's ``DistributedOptimizer(named_parameters=...)``): every rank gets the same names.
    """
    held = {id(p): p for group in optimizer.param_groups for p in group["params"]}
    named = [(name, p) for name, p in model.named_parameters() if id(p) in held]
    seen = {id(p) for _, p in named}
    return named + [(f"unnamed.{i}", p) for i, (k, p) in enumerate(held.items()) if k not in seen]


def _mark_steps(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer``'s steps as a torch LR scheduler marks those of the optimizer it
    was built with (``_opt_called``), unless they are marked already."""
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    @functools.wraps(step)
    def marked(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    marked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = marked  # type: ignore[method-assign]


def check_model(model: object, *, needs: str = "training_step") -> None:
    """Refuse a model that cannot be trained, naming what is missing."""
    if not isinstance(model, torch.nn.Module):
        raise MisconfigurationError(
            f"model={type(model).__name__} is not a torch.nn.Module. Subclass torch.nn.Module "
            "and add training_step(batch, batch_idx) and configure_optimizers()."
        )
    for method in (needs, "configure_optimizers") if needs == "training_step" else (needs,):
        if not callable(getattr(model, method, None)):
            raise MisconfigurationError(
                f"model {type(model).__name__} has no {method}(). Add it: see the model "
                "contract in cardcage.config.model_contract."
            )


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


_FORMATS = (
    "Return an optimizer, a list of them, (optimizers, schedulers), "
    "{'optimizer': ..., 'lr_scheduler': ...}, or a list of such dicts."
)


def _is_plateau(scheduler: Any) -> bool:
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def _scheduler_config(entry: Any, monitor: Any, where: str) -> SchedulerConfig:
    """One scheduler entry (an object or a dict), checked; ``monitor``: the enclosing
    optimizer dict's ``"monitor"``, the default of the entry's."""
    if not isinstance(entry, Mapping):
        entry = {"scheduler": entry}
    unknown = [str(k) for k in entry if k not in SCHEDULER_KEYS]
    if unknown:
        raise MisconfigurationError(
            f"{where}: a scheduler dict has unknown key(s) {unknown}; the keys are "
            f"{list(SCHEDULER_KEYS)}."
        )
    if "scheduler" not in entry:
        raise MisconfigurationError(
            f"{where}: a scheduler dict has no 'scheduler' key: {dict(entry)!r}. Put the "
            "scheduler object under 'scheduler'."
        )
    scheduler = entry["scheduler"]
    if not callable(getattr(scheduler, "step", None)) or not callable(
        getattr(scheduler, "state_dict", None)
    ):
        raise MisconfigurationError(
            f"{where}: {scheduler!r} is not a learning-rate scheduler (it needs step() and "
            "state_dict())."
        )
    interval = entry.get("interval", "epoch")
    if interval not in ("epoch", "step"):
        raise MisconfigurationError(
            f"{where}: a scheduler's interval={interval!r} is not valid: use 'epoch' or 'step'."
        )
    frequency = entry.get("frequency", 1)
    if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
        raise MisconfigurationError(
            f"{where}: a scheduler's frequency={frequency!r} is not valid: use an int >= 1."
        )
    strict = entry.get("strict", True)
    if not isinstance(strict, bool):
        raise MisconfigurationError(
            f"{where}: a scheduler's strict={strict!r} is not valid: use True or False."
        )
    monitor = entry.get("monitor", monitor)
    if monitor is not None and not isinstance(monitor, str):
        raise MisconfigurationError(
            f"{where}: a scheduler's monitor={monitor!r} is not valid: name a metric."
        )
    if _is_plateau(scheduler) and monitor is None:
        raise MisconfigurationError(
            f"{where}: ReduceLROnPlateau needs the metric it watches: return "
            "{'scheduler': ..., 'monitor': 'val_loss'} (or the name of another metric)."
        )
    return SchedulerConfig(scheduler, interval, frequency, monitor, strict)


def _optimizer_dict(
    entry: Mapping[Any, Any], where: str
) -> tuple[list[Any], list[SchedulerConfig]]:
    unknown = [str(k) for k in entry if k not in OPTIMIZER_KEYS]
    if unknown:
        hint = (
            " Optimizer frequencies (alternating optimizers) are not supported: give each "
            "optimizer its own steps with training_step(batch, batch_idx, optimizer_idx)."
            if "frequency" in unknown
            else ""
        )
        raise MisconfigurationError(
            f"{where}: an optimizer dict has unknown key(s) {unknown}; the keys are "
            f"{list(OPTIMIZER_KEYS)}.{hint}"
        )
    monitor = entry.get("monitor")
    return _as_list(entry.get("optimizer")), [
        _scheduler_config(s, monitor, where) for s in _as_list(entry.get("lr_scheduler"))
    ]


def takes_optimizer_idx(model: torch.nn.Module) -> bool:
    """Whether ``model.training_step`` takes ``optimizer_idx`` (Lightning 1.0's steps, one
    per optimizer)."""
    step = getattr(model, "training_step", None)
    if not callable(step):
        return False
    try:
        return "optimizer_idx" in inspect.signature(step).parameters
    except (TypeError, ValueError):
        return False


def configure_optimizers(model: torch.nn.Module) -> Optimization:
    """Call ``model.configure_optimizers()`` and normalise what it returned; a malformed
    scheduler entry (unknown key, bad interval or frequency) is refused here, naming it."""
    result = model.configure_optimizers()  # type: ignore[operator]
    where = f"configure_optimizers() of {type(model).__name__}"
    configs: list[SchedulerConfig] = []
    if isinstance(result, Mapping):
        optimizers, configs = _optimizer_dict(result, where)
    elif (
        isinstance(result, (list, tuple)) and result and all(isinstance(r, Mapping) for r in result)
    ):
        optimizers = []
        for entry in result:
            more, scheds = _optimizer_dict(entry, where)
            optimizers += more
            configs += scheds
    elif (
        isinstance(result, tuple)
        and len(result) == 2
        and isinstance(result[0], (list, tuple))
        and isinstance(result[1], (list, tuple))
    ):
        optimizers = list(result[0])
        configs = [_scheduler_config(s, None, where) for s in result[1]]
    else:
        optimizers = _as_list(result)
    if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise MisconfigurationError(f"{where} returned {result!r}. {_FORMATS}")
    per_optimizer = len(optimizers) > 1 and takes_optimizer_idx(model)
    return Optimization(optimizers, [c.scheduler for c in configs], per_optimizer, configs)


def extract_loss(output: Any, step: str = "training_step") -> torch.Tensor:
    """The loss tensor of a step's output (a tensor, or a dict holding ``"loss"``).

    The loss must hold one value (shape ``[]``, or ``[1]``): backward needs a scalar. Checking
    that reads only the tensor's shape, never its value (no device sync).
    """
    if isinstance(output, torch.Tensor):
        loss: torch.Tensor = output
        what = "a loss of shape"
    elif isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        loss = output["loss"]
        what = "a dict whose 'loss' has shape"
    else:
        raise MisconfigurationError(
            f"{step} returned {type(output).__name__}; return a loss tensor or a dict holding "
            "'loss'."
        )
    if loss.numel() != 1:
        shape = list(loss.shape)
        raise MisconfigurationError(
            f"{step} returned {what} {shape} ({loss.numel()} values); backward needs "
            f"a single value. Reduce it in {step}, e.g. return loss.mean() (or loss.sum())."
        )
    return loss


def metrics_of(output: Any, prefix: str) -> dict[str, torch.Tensor]:
    """The scalar tensors of a validation/test step's output, named ``prefix_name``."""
    if isinstance(output, torch.Tensor):
        return {f"{prefix}_loss": output.detach()}
    if isinstance(output, Mapping):
        return {
            (f"{prefix}_{key}" if not str(key).startswith(prefix) else str(key)): value.detach()
            for key, value in output.items()
            if isinstance(value, torch.Tensor) and value.numel() == 1
        }
    return {}


def batch_size(batch: Any) -> int:
    """How many samples ``batch`` holds: dim 0 of its first tensor (depth first through
    dicts, lists and tuples), as Lightning 1.0 counts them; 1 when it holds no tensor or
    only a scalar one."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    items = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(items, (list, tuple)) or isinstance(batch, Mapping):
        for item in items:
            if isinstance(item, (torch.Tensor, Mapping, list, tuple)):
                return batch_size(item)
    return 1


def weighted_sums(
    outputs: Iterable[tuple[dict[str, torch.Tensor], int]],
) -> dict[str, tuple[float, float]]:
    """For each metric, ``(sum of value x batch size, sum of batch sizes)`` over the steps
    that reported it: what ranks add up before dividing, so that the mean over several
    processes is the mean over the whole data."""
    sums: dict[str, tuple[float, float]] = {}
    for output, size in outputs:
        for key, value in output.items():
            total, count = sums.get(key, (0.0, 0.0))
            sums[key] = (total + float(value) * size, count + size)
    return sums
