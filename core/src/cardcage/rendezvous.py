"""The rendezvous of a job's processes: the store they meet at, and how long they may take.

When no ``MASTER_PORT`` is set on a single node, the launcher hosts the rendezvous
``TCPStore`` on a port the kernel picks (port 0), so two jobs started at once never race for
a port; ranks then report their arrival (:func:`arrival_key`), and a rank that never
arrives is named by the supervisor.

A single-node job lets no one in from outside the machine: the hosted store listens on
127.0.0.1 only (torch's ``TCPStore`` would listen on every interface unless it is handed a
listening socket), and gloo binds to the loopback interface (:func:`loopback_interface`).
"""

from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta
from typing import Any

from cardcage.errors import MisconfigurationError

# Re-exported: the rest of the core (and the SDK) find them here.
from cardcage.variables import INIT_TIMEOUT as INIT_TIMEOUT
from cardcage.variables import init_timeout as init_timeout

HOSTED_STORE = "CARDCAGE_HOSTED_STORE"
#: The loopback address a single-node job meets at when nothing else is set.
DEFAULT_ADDRESS = "127.0.0.1"
#: Seconds the name of the rendezvous host may take to resolve before the job is refused.
RESOLVE_TIMEOUT = 5.0


_hosted: dict[str, Any] = {}


def listening_socket(address: str) -> tuple[int, int]:
    """A socket listening on ``address`` alone, on a port the kernel picks: ``(fd, port)``.

    The descriptor is the store's from then on: Python never closes it (closing it under the
    store's serving thread aborts the process at exit); the process's exit does."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    server = socket.create_server((address, 0), family=family, backlog=128)
    port = int(server.getsockname()[1])
    return server.detach(), port


def loopback_interface() -> str | None:
    """The name of the loopback interface (``lo`` on Linux, ``lo0`` on macOS), if any."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in ("lo", "lo0") if name in names), None)


def host_store(world_size: int) -> Any:
    """Host the job's TCPStore in this process, on 127.0.0.1 only, on a free port."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    fd, port = listening_socket(DEFAULT_ADDRESS)
    store = TCPStore(
        DEFAULT_ADDRESS,
        port,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=init_timeout()),
        master_listen_fd=fd,
        use_libuv=False,  # libuv's server ignores master_listen_fd and listens everywhere
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


# -- the rendezvous address, checked before any process starts -------------------------------

_resolved: dict[str, str] = {}


def resolve(host: str, timeout: float = RESOLVE_TIMEOUT) -> str | None:
    """Resolve ``host`` with ``socket.getaddrinfo`` in a daemon thread, giving up after
    ``timeout`` seconds: ``None`` when it resolves, else the resolver's error in words.
    Successes are remembered per name (one lookup per process)."""
    if host in _resolved:
        return None
    outcome: list[str | None] = []

    def lookup() -> None:
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            outcome.append(None)
        except (OSError, UnicodeError) as error:  # socket.gaierror, an IDNA error
            outcome.append(str(error) or type(error).__name__)

    thread = threading.Thread(target=lookup, name="cardcage-resolve", daemon=True)
    thread.start()
    thread.join(timeout)
    if not outcome:
        return f"the resolver gave no answer within {timeout:g}s"
    error = outcome[0]
    if error is None:
        _resolved[host] = host
    return error


def check_master_address(selection: Any, needs_rendezvous: bool) -> None:
    """Refuse a rendezvous host that does not resolve, in the process that called ``fit``,
    before any process or port exists (a rank would otherwise wait for the others until
    ``CARDCAGE_INIT_TIMEOUT``, the cause unnamed).

    Only a job of several processes that meet through ``MASTER_ADDR`` is checked, and only
    an address that was given (``MASTER_ADDR``) or that a cluster environment derived (the
    first host of the SLURM node list); the default loopback address is never looked up.
    Whether something listens there is the rendezvous's to find out.
    """
    if not needs_rendezvous or selection.world_size <= 1:
        return
    given = os.environ.get("MASTER_ADDR", "").strip()
    address = given or (selection.master_address or "").strip()
    if not address or address == DEFAULT_ADDRESS:
        return
    error = resolve(address)
    if error is None:
        return
    if given:
        what = f"environment variable MASTER_ADDR={address!r}"
        fix = (
            "Set MASTER_ADDR to the host name or IP address of the machine that runs rank 0 "
            "(one every node can resolve), or unset it on a single machine"
        )
    else:
        what = (
            f"the rendezvous host {address!r} (derived by the {selection.cluster!r} cluster "
            "environment)"
        )
        fix = "Set MASTER_ADDR to the host name or IP address of the machine that runs rank 0"
    raise MisconfigurationError(
        f"{what} does not resolve ({error}), so the job's processes could not meet there. {fix}."
    )
