"""The model contract: what cardcage asks of a ``torch.nn.Module`` and how it reads the answers.

A model has ``training_step(batch, batch_idx)`` returning a loss tensor or a dict holding
``"loss"``, and ``configure_optimizers()`` returning an optimizer, a list of them, a pair
``(optimizers, schedulers)``, or a dict with ``"optimizer"`` and ``"lr_scheduler"``.
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


@dataclass
class Optimization:
    """The optimizers and learning-rate schedulers a model asked for."""

    optimizers: list[torch.optim.Optimizer]
    schedulers: list[Any] = field(default_factory=list)
    per_optimizer_steps: bool = False  # training_step takes optimizer_idx

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


def configure_optimizers(model: torch.nn.Module) -> Optimization:
    """Call ``model.configure_optimizers()`` and normalise what it returned."""
    result = model.configure_optimizers()  # type: ignore[operator]
    schedulers: list[Any] = []
    if isinstance(result, Mapping):
        optimizers = _as_list(result.get("optimizer"))
        schedulers = _as_list(result.get("lr_scheduler"))
    elif (
        isinstance(result, tuple)
        and len(result) == 2
        and isinstance(result[0], (list, tuple))
        and isinstance(result[1], (list, tuple))
    ):
        optimizers, schedulers = list(result[0]), list(result[1])
    else:
        optimizers = _as_list(result)
    schedulers = [s["scheduler"] if isinstance(s, Mapping) else s for s in schedulers]
    if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise MisconfigurationError(
            f"configure_optimizers() of {type(model).__name__} returned {result!r}. Return "
            "an optimizer, a list of them, (optimizers, schedulers), or "
            "{'optimizer': ..., 'lr_scheduler': ...}."
        )
    per_optimizer = (
        len(optimizers) > 1
        and "optimizer_idx"
        in inspect.signature(
            model.training_step  # type: ignore[arg-type]
        ).parameters
    )
    return Optimization(optimizers, schedulers, per_optimizer)


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


def mean_metrics(outputs: Iterable[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Average each metric over the steps that reported it."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for output in outputs:
        for key, value in output.items():
            sums[key] = sums.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1
    return {key: sums[key] / counts[key] for key in sums}
