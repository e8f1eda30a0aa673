"""The ranks agree on what they reduce together, before they reduce it.

A cross-rank metric reduction packs each rank's values into one tensor, position by
position: when the ranks logged different names (or one rank logged a name that another did
not, or one rank's validation loader was empty), the positions no longer mean the same thing
on every rank, and rank 1's ``zzz`` was added into rank 0's ``val_loss``, or one rank waited
in a collective that the others never joined until ``CARDCAGE_TIMEOUT``.

So each reduction of names is preceded by :func:`agree`: every rank all-gathers a digest of
what it is about to reduce (where it was logged, the names in order, how many), a fixed-size
tensor of ``CHUNKS + 2`` float32, through the backend's own ``all_gather``. Where the digests
are equal (the common path: one small collective) the reduction goes on; where they differ,
each rank's names are exchanged (``broadcast``, once per rank: only then) and every rank raises
the same :class:`~cardcage.MisconfigurationError`, naming each rank's names and the hook that
logged them.

A value logged with ``sync_dist=True`` on a step is reduced at once, in a collective of its
own: its digest travels in that same collective (:func:`step_digest`, :func:`step_mismatch`),
so the step pays nothing extra; the check is read when the step values are read (every
``log_every_n_steps``) and at each epoch's end, never in between.

With one process (``world_size`` 1) nothing here runs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from cardcage.errors import MisconfigurationError

#: How many float32 carry a digest's hash: ``CHUNKS`` integers of :func:`chunk_bits` bits each.
CHUNKS = 4


def chunk_bits(world_size: int) -> int:
    """Bits per chunk of a digest, so that ``world_size`` chunks sum exactly in float32 (a
    24-bit significand): 23 bits for two ranks, 22 for up to four, and so on."""
    return max(24 - max(world_size - 1, 1).bit_length(), 8)


def fingerprint(parts: Sequence[str], world_size: int) -> list[float]:
    """``parts`` hashed (blake2b) into :data:`CHUNKS` integers, as floats exact in float32."""
    bits = chunk_bits(world_size)
    text = "\x1f".join(parts).encode()
    value = int.from_bytes(hashlib.blake2b(text, digest_size=16).digest(), "big")
    mask = (1 << bits) - 1
    return [float((value >> (bits * i)) & mask) for i in range(CHUNKS)]


def _gathered_disagree(strategy: Any, row: list[float]) -> bool:
    """All-gather ``row`` (one small collective, its last value a flag: 1 where this rank's
    own checks passed); whether any rank's differs, or any rank's flag is down."""
    own = torch.tensor(row, dtype=torch.float32, device=strategy.device)
    rows = strategy.all_gather(own).cpu()
    return not bool((rows == rows[0]).all()) or not bool((rows[:, -1] == 1).all())


def _each_rank(strategy: Any, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (one broadcast per rank: the mismatch path)."""
    return [strategy.broadcast(obj, src=rank) for rank in range(strategy.world_size)]


#: The hooks behind :mod:`cardcage.train.metrics`' places (only training steps log on_step).
HOOKS = {"train batch": "training_step (or a training batch hook)"}


def _said(names: Sequence[str]) -> str:
    return "[" + ", ".join(repr(n) for n in names) + "]" if names else "nothing"


def agree(
    strategy: Any,
    hook: str,
    names: Sequence[str],
    *,
    note: str = "",
    steps_ok: bool = True,
    steps: Sequence[tuple[str, str]] = (),
) -> None:
    """Before a reduction of ``names`` (in the order they are packed) logged in ``hook``:
    return when every rank is about to reduce the same names, else raise on every rank a
    :class:`~cardcage.MisconfigurationError` naming each rank's.

    ``note``: what this rank adds to the message on a mismatch (the batches each validation
    loader ran). ``steps_ok``: whether this rank's on-step ``sync_dist`` checks since the last
    agreement passed; ``steps``: those values' ``(hook, name)``, in the order logged. The
    flag travels in the same collective, so that every rank learns of a failed step check
    at the same point.
    """
    world = strategy.world_size
    if world <= 1:
        return
    row = [*fingerprint([hook, *names], world), float(len(names)), float(steps_ok)]
    if not _gathered_disagree(strategy, row):
        return
    seen = _each_rank(strategy, (list(names), note, bool(steps_ok), list(steps)))
    if not all(ok for _, _, ok, _ in seen):
        raise MisconfigurationError(_step_message([s for *_, s in seen], None))
    lines = "; ".join(
        f"rank {rank} {_said(logged)}{f' ({said})' if said else ''}"
        for rank, (logged, said, _, _) in enumerate(seen)
    )
    order = len({tuple(sorted(n)) for n, *_ in seen}) == 1
    raise MisconfigurationError(
        f"The ranks reduce different metrics after {hook}, so their values cannot be added "
        f"up position by position: {lines}."
        + (" The same names, in a different order." if order else "")
        + " Every rank must log (or return) the same metric names at the same point: log "
        "each name on every rank (a placeholder where a rank has no value), give every rank "
        "at least one batch of each validation and test loader, or log a rank's own values "
        "with sync_dist=False."
    )


def step_digest(hook: str, name: str, world_size: int, device: torch.device) -> torch.Tensor:
    """The digest that an on-step ``sync_dist`` value of ``name`` carries in its collective:
    :data:`CHUNKS` float32, summed with the value's."""
    return torch.tensor(fingerprint([hook, name], world_size), dtype=torch.float32, device=device)


def step_mismatch(summed: torch.Tensor, own: torch.Tensor, world_size: int) -> torch.Tensor:
    """Whether a summed digest differs from ``world_size`` times this rank's (a 0-dim bool
    tensor, read later: no host-device sync here). With two ranks it differs exactly when
    the other rank's digest differs; with more, unless this rank's equals their mean."""
    return (summed != own * world_size).any()


def _step_message(
    each: Sequence[Sequence[tuple[str, str]]] | None, mine: Sequence[tuple[str, str]] | None
) -> str:
    fix = (
        " Every rank must log the same names with sync_dist=True on a step, in the same "
        "order: each such value is reduced at once, in a collective of its own. Log each "
        "name on every rank (a placeholder where a rank has no value), or log a rank's own "
        "values with sync_dist=False."
    )
    if each is None:
        logged = _said(list(dict.fromkeys(name for _, name in mine or ())))
        hooks = sorted({HOOKS.get(hook, hook) for hook, _ in mine or ()})
        return (
            f"The ranks logged different values with sync_dist=True on a step in "
            f"{' / '.join(hooks)}: this rank logged {logged} since the last check, and "
            f"another rank other names, or the same in another order." + fix
        )
    lines = "; ".join(
        f"rank {rank} {_said(list(dict.fromkeys(name for _, name in logged)))}"
        for rank, logged in enumerate(each)
    )
    hooks = sorted({HOOKS.get(hook, hook) for logged in each for hook, _ in logged})
    return (
        f"The ranks logged different values with sync_dist=True on a step in "
        f"{' / '.join(hooks) or 'a step'}, so their values were added into other names' "
        f"(in the order logged since the last check): {lines}." + fix
    )


def raise_step_mismatch(steps: Sequence[tuple[str, str]]) -> None:
    """A failed on-step check found by this rank alone (no collective: the other ranks may
    not be at this point): raise, naming this rank's values."""
    raise MisconfigurationError(_step_message(None, steps))


def agree_train_batches(strategy: Any, batches: int | None) -> None:
    """Before the first training step: every rank trains the same number of batches per
    epoch (``None``: the loader has no length), else every rank raises, naming each rank's.
    One small collective."""
    world = strategy.world_size
    if world <= 1:
        return
    said = "unknown (no len())" if batches is None else str(batches)
    row = [*fingerprint(["train batches", said], world), 0.0, 1.0]
    if not _gathered_disagree(strategy, row):
        return
    seen = _each_rank(strategy, said)
    lines = ", ".join(f"rank {rank} {value}" for rank, value in enumerate(seen))
    raise MisconfigurationError(
        f"The ranks' train loaders give different numbers of batches per epoch: {lines}. "
        "Every optimizer step is a collective of all ranks, so a rank with more batches "
        "would wait for the others forever. Give every rank the same number of batches (a "
        "DistributedSampler, which replace_sampler_ddp=True adds, pads them to the same "
        "length), or set limit_train_batches to at most the shortest."
    )
