"""What ``self.log`` records, and where it goes: ``trainer.callback_metrics`` (the latest
values, tensors), ``trainer.logged_metrics`` (floats, as the logger got them) and the logger.

Values stay tensors until they are written: a step's value is read (``float``) only every
``log_every_n_steps`` steps, so logging adds no host-device sync to the other steps. Epoch
values are means weighted by batch size (each step adds ``value x size`` and ``size``), reduced
across ranks in one collective when logged with ``sync_dist=True``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from cardcage.config.model_contract import batch_size as size_of_batch
from cardcage.errors import MisconfigurationError
from cardcage.train import agreement

#: The hooks' logging defaults: ``(on_step, on_epoch)``.
STEP_DEFAULTS = (True, False)
EPOCH_DEFAULTS = (False, True)
#: Where ``self.log`` is called from, as the loop sets it: training batches log per step by
#: default; validation and test batches and every epoch-level hook per epoch.
TRAIN_BATCH, TRAIN_EPOCH, EVAL_BATCH, EVAL_EPOCH = "train batch", "train epoch", "eval", "eval end"
_REDUCE_FX = ("mean", torch.mean)


@dataclass
class _EpochValue:
    total: torch.Tensor  # sum of value x batch size
    size: torch.Tensor  # sum of batch sizes
    sync_dist: bool
    logger: bool
    prog_bar: bool
    forked: bool  # logged on_step too: the epoch value is written as <name>_epoch


@dataclass
class MetricStore:
    """The metrics of one training process. The loop sets ``place`` (where ``self.log`` is
    called from), ``batch`` (the batch a step trains on: its size weighs epoch means) and
    ``sanity_checking``."""

    place: str | None = None
    batch: Any = None
    sanity_checking: bool = False
    #: The latest values, 0-dim tensors (``trainer.callback_metrics``).
    callback_metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    #: Step values logged since the last write, for the logger.
    step_values: dict[str, torch.Tensor] = field(default_factory=dict)
    #: ``prog_bar=True`` values, latest.
    bar_values: dict[str, torch.Tensor] = field(default_factory=dict)
    _epoch: dict[str, _EpochValue] = field(default_factory=dict)
    _steps_sync: dict[str, bool] = field(default_factory=dict)
    reduce: Any = None  # the backend's reduce, set by the loop (several ranks)
    world_size: int = 1
    #: The backend (several ranks): the ranks agree through it on what they reduce
    #: (:mod:`cardcage.train.agreement`). ``None``: no agreement is checked.
    strategy: Any = None
    #: Each on-step sync_dist value's digest, by (place, name, device), made once.
    _step_digests: dict[tuple[str, str, Any], torch.Tensor] = field(default_factory=dict)
    #: The on-step sync_dist values logged since the last check, ``(place, name)``, and
    #: whether any of their digests differed on another rank (a bool tensor, unread).
    _step_logged: list[tuple[str, str]] = field(default_factory=list)
    _step_bad: torch.Tensor | None = None

    def log(
        self,
        name: str,
        value: Any,
        *,
        prog_bar: bool = False,
        logger: bool = True,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: Any = "mean",
        sync_dist: bool = False,
        batch_size: int | None = None,
    ) -> None:
        if self.sanity_checking:  # Lightning 1.0 records nothing from the sanity check
            return
        place = self.place
        if place is None:
            raise MisconfigurationError(
                f"self.log({name!r}, ...) was called outside the training, validation and test "
                "hooks, where no step or epoch owns the value. Log from a step or an epoch hook."
            )
        if not any(reduce_fx is known for known in _REDUCE_FX) and reduce_fx != "mean":
            raise MisconfigurationError(
                f"self.log({name!r}, ..., reduce_fx={reduce_fx!r}): only the mean (the default, "
                "weighted by batch size) is supported. Leave reduce_fx out."
            )
        epoch_level = place in (TRAIN_EPOCH, EVAL_EPOCH)
        default_step, default_epoch = STEP_DEFAULTS if place == TRAIN_BATCH else EPOCH_DEFAULTS
        on_step = default_step if on_step is None else on_step
        on_epoch = default_epoch if on_epoch is None else on_epoch
        if epoch_level and on_step:
            raise MisconfigurationError(
                f"self.log({name!r}, ..., on_step=True) in an epoch-end hook: there is no step "
                "there. Leave on_step out (epoch hooks log on_epoch=True)."
            )
        if on_step and place == EVAL_BATCH:
            raise MisconfigurationError(
                f"self.log({name!r}, ..., on_step=True) in a validation or test step: "
                "cardcage writes validation and test values once per run of the loop, as "
                "means weighted by batch size. Leave on_step out (on_epoch=True is the "
                "default there)."
            )
        if not (on_step or on_epoch):
            raise MisconfigurationError(
                f"self.log({name!r}, ..., on_step=False, on_epoch=False) records nothing. Set "
                "on_step=True or on_epoch=True."
            )
        tensor = _scalar(name, value)
        if on_step:
            if sync_dist and self.world_size > 1:
                tensor = self._sync_step(place, name, tensor)
            key = f"{name}_step" if on_epoch else name
            self.callback_metrics[name] = tensor
            if on_epoch:
                self.callback_metrics[key] = tensor
            if logger:
                self.step_values[key] = tensor
            if prog_bar:
                self.bar_values[name] = tensor
        if on_epoch:
            size = 1 if epoch_level else batch_size or size_of_batch(self.batch) or 1
            total = (
                tensor.double() * size if tensor.device.type in ("cpu", "cuda") else tensor * size
            )
            held = self._epoch.get(name)
            if held is None:
                self._epoch[name] = _EpochValue(
                    total,
                    torch.tensor(float(size), dtype=total.dtype, device=total.device),
                    sync_dist,
                    logger,
                    prog_bar,
                    on_step,
                )
            else:
                held.total = held.total + total
                held.size = held.size + size

    def _sync_step(self, place: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """An on-step ``sync_dist`` value averaged over the ranks, in one collective that
        also carries the digest of ``(place, name)``: whether every rank logged the same name
        here is read later (:meth:`steps_agreed`), never in the step."""
        world = self.world_size
        value = tensor.float().reshape(1)
        if self.strategy is None:
            return self.reduce(value, op="mean").reshape(())  # type: ignore[no-any-return]
        key = (place, name, value.device)
        own = self._step_digests.get(key)
        if own is None:
            own = agreement.step_digest(place, name, world, value.device)
            self._step_digests[key] = own
        summed = self.reduce(torch.cat([value, own]), op="sum")
        bad = agreement.step_mismatch(summed[1:], own, world)
        held = self._step_bad
        self._step_bad = bad if held is None else held.to(bad.device) | bad
        self._step_logged.append((place, name))
        return summed[0] / world  # type: ignore[no-any-return]

    def steps_agreed(self) -> tuple[bool, list[tuple[str, str]]]:
        """Whether the on-step ``sync_dist`` values since the last call agreed on every rank
        (as this rank sees it), and their ``(place, name)``; the record starts afresh."""
        bad, logged = self._step_bad, self._step_logged
        self._step_bad, self._step_logged = None, []
        return bad is None or not bool(bad), logged

    def synced(self, *helds: dict[str, Any]) -> list[str]:
        """The names that ``sync_dist`` reduces across ranks when ``helds`` (values
        :meth:`take_epoch` took) are closed together, in the order they are packed."""
        return sorted({k for held in helds for k, v in held.items() if v.sync_dist})

    def epoch_held(self) -> dict[str, Any]:
        """The epoch values held now (not taken out)."""
        return self._epoch

    def take_epoch(self) -> dict[str, Any]:
        """The epoch values held since the last call (or close), taken out of the store:
        evaluation keeps each loader's apart (:meth:`put_epoch` adds them back)."""
        held, self._epoch = self._epoch, {}
        return held

    def put_epoch(self, held: dict[str, Any]) -> None:
        """Add epoch values :meth:`take_epoch` took back to those held (sums add up)."""
        for name, value in held.items():
            mine = self._epoch.get(name)
            if mine is None:
                self._epoch[name] = dataclasses.replace(value)
            else:
                mine.total, mine.size = mine.total + value.total, mine.size + value.size

    def take_step_values(self) -> dict[str, float]:
        """The step values logged since the last call, read as floats (one sync). Where an
        on-step ``sync_dist`` value's name differed on another rank, this rank refuses, with
        no collective: the other ranks may not be at this point (the launcher stops them)."""
        if self._step_bad is not None:
            agreed, logged = self.steps_agreed()
            if not agreed:
                agreement.raise_step_mismatch(logged)
        values = {k: float(v) for k, v in self.step_values.items()}
        self.step_values.clear()
        return values

    def close_epoch(self, hook: str = "an epoch", agreed: bool = False) -> dict[str, float]:
        """The epoch means logged since the last call (across ranks for ``sync_dist``),
        into ``callback_metrics``; returns those for the logger, as floats.

        With several ranks, every rank calls it at the same point, and first the ranks
        agree on the ``sync_dist`` names (and the on-step checks since the last agreement)
        in one small collective, naming ``hook`` if they differ; ``agreed``: the caller had
        them agree already (:func:`~cardcage.train.agreement.agree`)."""
        held, self._epoch = self._epoch, {}
        synced = self.synced(held)
        if self.world_size > 1 and self.strategy is not None and not agreed:
            steps_ok, steps = self.steps_agreed()
            agreement.agree(self.strategy, hook, synced, steps_ok=steps_ok, steps=steps)
        if not held:
            return {}
        if synced and self.world_size > 1:
            # every rank's sums, added up in one collective
            first = held[synced[0]].total
            local = torch.stack(
                [t for k in synced for t in (held[k].total.to(first), held[k].size.to(first))]
            )
            total = self.reduce(local, op="sum")
            for i, k in enumerate(synced):
                held[k].total, held[k].size = total[2 * i], total[2 * i + 1]
        logged: dict[str, float] = {}
        for name, value in held.items():
            mean = value.total / value.size if float(value.size) else torch.tensor(math.nan)
            key = f"{name}_epoch" if value.forked else name
            reading = mean.float()
            self.callback_metrics[key] = reading
            if not value.forked:
                self.callback_metrics[name] = reading
            if value.prog_bar:
                self.bar_values[name] = reading
            if value.logger:
                logged[key] = float(reading)
        return logged


def _scalar(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise MisconfigurationError(
                f"self.log({name!r}, value): value has shape {tuple(value.shape)}; log one "
                "number (a 0-dim tensor or a float), e.g. value.mean()."
            )
        return value.detach().reshape(())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value))
    raise MisconfigurationError(
        f"self.log({name!r}, {value!r}): log a number or a one-element tensor."
    )
