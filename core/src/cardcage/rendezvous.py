"""The rendezvous of a job's processes: the store they meet at, and how long they may take.

When no ``MASTER_PORT`` is set on a single node, the launcher hosts the rendezvous
``TCPStore`` on a port the kernel picks (port 0), so two jobs started at once never race for
a port; ranks then report their arrival (:func:`arrival_key`), and a rank that never
arrives is named by the supervisor.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from cardcage.errors import MisconfigurationError

HOSTED_STORE = "CARDCAGE_HOSTED_STORE"
INIT_TIMEOUT = "CARDCAGE_INIT_TIMEOUT"
#: The loopback address a single-node job meets at when nothing else is set.
DEFAULT_ADDRESS = "127.0.0.1"


def init_timeout() -> float:
    """Seconds every rank may take to arrive (``CARDCAGE_INIT_TIMEOUT``, default 300)."""
    raw = os.environ.get(INIT_TIMEOUT, "300")
    try:
        value = float(raw)
    except ValueError:
        raise MisconfigurationError(
            f"environment variable {INIT_TIMEOUT}={raw!r} is not a number of seconds."
        ) from None
    return value


_hosted: dict[str, Any] = {}


def host_store(world_size: int) -> Any:
    """Host the job's TCPStore in this process on a free port (kernel-chosen, no race)."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    store = TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=init_timeout()),
    )
    _hosted["store"] = store
    return store


def hosted_store() -> Any | None:
    """The store this process hosts, if it hosts one."""
    return _hosted.get("store")


def arrival_key(rank: int) -> str:
    return f"cardcage/arrived/{rank}"


def release_store() -> None:
    """Forget the store this process hosts (its workers have all left)."""
    _hosted.pop("store", None)
