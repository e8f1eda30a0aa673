"""How the ranks agree on the step they all stop at before a requeue, through the job's
rendezvous store and off the training loop (step 2 of :mod:`cardcage.train.requeue`)."""

from __future__ import annotations

import math
import sys
import time
from datetime import timedelta
from typing import Any

#: Added to the ``request`` key when a fit ends, to release every watcher.
DONE = 1 << 40
#: The initial margin, in seconds of training at the fastest rank's step rate.
MARGIN_S = 0.25
MAX_ROUNDS = 12
FOREVER = timedelta(days=1)
POLL_S = 0.005
AGREE_TIMEOUT = timedelta(seconds=120)
NEVER = -1


def say(message: str) -> None:
    """One line on stderr: requeue events are rare and belong in the job's log."""
    print(f"cardcage: requeue: {message}", file=sys.stderr, flush=True)


def poll(handler: Any, client: Any, keys: list[str], timeout: timedelta = AGREE_TIMEOUT) -> bool:
    """Wait until every key is set (False: the fit ended first)."""
    deadline = time.monotonic() + timeout.total_seconds()
    while not client.check(keys):
        if handler.closed.wait(POLL_S):
            return False
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {', '.join(keys)} within {timeout.total_seconds():.0f}s")
    return True


def agree(handler: Any, client: Any) -> None:
    """Rank ``handler.rank``'s part in agreeing on the step every rank stops at (see
    :mod:`cardcage.train.requeue`, step 2); returns once committed, aborted, or the fit ended."""
    from torch.distributed import DistStoreError  # type: ignore[attr-defined]

    prefix, rank, world = handler.prefix, handler.rank, handler.world_size
    while True:
        try:  # blocks until a signal, the end of the fit (DONE), or the store goes away
            client.wait([prefix + "request"], FOREVER)
            break
        except DistStoreError:
            if handler.closed.is_set():
                return
    if int(client.add(prefix + "request", 0)) >= DONE or handler.closed.is_set():
        return
    trainer = handler.trainer
    assert trainer is not None
    step = trainer.global_step
    started, first = handler.baseline
    elapsed = time.monotonic() - started
    rate = (step - first) / elapsed if step > first and elapsed > 0 else 0.0
    client.set(f"{prefix}report/{rank}", f"{step} {rate:.6g}")
    max_rate = 0.0
    if rank == 0:
        keys = [f"{prefix}report/{r}" for r in range(world)]
        if not poll(handler, client, keys):
            return
        reports = [client.get(key).decode().split() for key in keys]
        steps = [int(report[0]) for report in reports]
        max_rate = max(float(report[1]) for report in reports)
        stop = max(steps) + 1 + math.ceil(max_rate * MARGIN_S)
        say(
            f"stop requested; all {world} ranks stop after global step {stop} (ranks at "
            f"steps {min(steps)}..{max(steps)}, {max_rate:.3g} steps/s)"
        )
        client.set(f"{prefix}round/0", str(stop))
    for round_ in range(MAX_ROUNDS):
        key = f"{prefix}round/{round_}"
        if not poll(handler, client, [key]):
            return
        stop = int(client.get(key))
        handler.rounds[stop] = round_
        trainer.stop_at_step = stop
        now = trainer.global_step  # read after the write: below `stop`, the loop sees it
        client.set(f"{prefix}ack/{round_}/{rank}", "ok" if now < stop else f"late {now}")
        decision_key = f"{prefix}decision/{round_}"
        if rank == 0:
            keys = [f"{prefix}ack/{round_}/{r}" for r in range(world)]
            if not poll(handler, client, keys):
                return
            acks = [client.get(key).decode() for key in keys]
            late = [int(ack.split()[1]) for ack in acks if ack.startswith("late")]
            if not late:
                decision = "commit"
            elif round_ + 1 < MAX_ROUNDS:
                scale = 2 ** (round_ + 1)
                margin = max(scale, math.ceil(max_rate * MARGIN_S * scale))
                later = max(late) + 1 + margin
                say(f"ranks passed step {stop} before they heard of it; stopping at {later}")
                client.set(f"{prefix}round/{round_ + 1}", str(later))
                decision = f"retry {later}"
            else:
                decision = "abort"
            client.set(decision_key, decision)
        if not poll(handler, client, [decision_key]):
            return
        decision = client.get(decision_key).decode()
        if decision == "abort":
            trainer.stop_at_step = NEVER
            if rank == 0:
                say(f"no agreement after {MAX_ROUNDS} rounds: training goes on, no checkpoint")
            return
        if decision == "commit":
            return
