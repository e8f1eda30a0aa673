"""The rendezvous of a job's processes: the store they meet at, and how long they may take.

When no ``MASTER_PORT`` is set on a single node, the launcher hosts the rendezvous
``TCPStore`` on a port the kernel picks (port 0), so two jobs started at once never race for
a port; ranks then report their arrival (:func:`arrival_key`), and a rank that never
arrives is named by the supervisor.

A single-node job lets no one in from outside the machine: the hosted store listens on one
loopback address only (torch's ``TCPStore`` would listen on every interface unless it is
handed a listening socket), and gloo binds to the loopback interface
(:func:`loopback_interface`). That address is where the ranks dial (:func:`meeting_address`):
``MASTER_ADDR`` when it is a loopback address (127.0.0.0/8, ``::1``, a name such as
``localhost`` that resolves to one), else the loopback address of its family.

Before any process or port exists, :func:`check_launch` refuses what would fail later: a
``MASTER_ADDR`` that does not resolve, or that is not this machine's when every rank runs
here; a ``MASTER_PORT`` already in use where this process's job will listen on it; more
processes than this machine can start (:func:`cardcage.config.flags.check_process_count`).
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import threading
from datetime import timedelta
from typing import Any

from cardcage.config.flags import check_process_count

# Re-exported: the rest of the core (and the SDK) find them here.
from cardcage.config.variables import INIT_TIMEOUT, init_timeout
from cardcage.errors import MisconfigurationError

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


def host_store(world_size: int, address: str = DEFAULT_ADDRESS) -> Any:
    """Host the job's TCPStore in this process, on ``address`` only (a loopback address, see
    :func:`meeting_address`), on a free port."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    fd, port = listening_socket(address)
    store = TCPStore(
        address,
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

#: The addresses each name resolved to (numeric), per process.
_resolved: dict[str, list[str]] = {}


def resolve(host: str, timeout: float = RESOLVE_TIMEOUT) -> str | None:
    """Resolve ``host`` with ``socket.getaddrinfo`` in a daemon thread, giving up after
    ``timeout`` seconds: ``None`` when it resolves, else the resolver's error in words.
    Successes are remembered per name (one lookup per process), with their addresses."""
    if host in _resolved:
        return None
    outcome: list[str | None] = []

    def lookup() -> None:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            _resolved[host] = [str(info[4][0]) for info in infos]
            outcome.append(None)
        except Exception as error:  # socket.gaierror, an IDNA error, ...
            outcome.append(str(error) or type(error).__name__)

    thread = threading.Thread(target=lookup, name="cardcage-resolve", daemon=True)
    thread.start()
    thread.join(timeout)
    if not outcome:
        return f"the resolver gave no answer within {timeout:g}s"
    return outcome[0]


LOOPBACK = {4: "127.0.0.1", 6: "::1"}


def bind_error(address: str, port: int = 0) -> OSError | None:
    """Why this machine cannot listen on ``address`` (a numeric IP) at ``port``, or ``None``.

    Binding sends nothing: it only asks the kernel whether the address is one of this
    machine's (``EADDRNOTAVAIL`` when it is not, ``EAFNOSUPPORT`` without IPv6)."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, port))
    except OSError as error:
        return error
    return None


def _words(error: OSError) -> str:
    reason = os.strerror(error.errno) if error.errno else str(error)
    return f"{reason} (errno {error.errno})" if error.errno else reason


def local_meeting(address: str) -> tuple[str | None, str]:
    """Where the ranks of a single-node job meet when ``MASTER_ADDR`` is ``address``:
    ``(numeric loopback address, "")``, or ``(None, why)`` when ``address`` is not this
    machine's.

    A loopback address (127.0.0.0/8, ``::1``; a name resolving to one) is used as it is. A
    wildcard (``0.0.0.0``, ``::``) or an address of one of this machine's other interfaces
    meets on the loopback address of its family (of the other family when that one is off):
    every rank runs here, and a store on loopback lets no one from outside in. An address
    the machine does not have is refused (see :func:`bind_error`: no packet is sent)."""
    unresolved = resolve(address)
    if unresolved is not None:
        return None, unresolved
    problems: list[str] = []
    for found in _resolved[address]:
        ip = ipaddress.ip_address(found.partition("%")[0])
        if ip.is_loopback:
            candidates = [str(ip)]
        else:
            if not ip.is_unspecified:
                foreign = bind_error(str(ip))
                if foreign is not None:
                    problems.append(f"{ip} is not an address of this machine: {_words(foreign)}")
                    continue
            candidates = [LOOPBACK[ip.version], LOOPBACK[10 - ip.version]]
        for candidate in candidates:
            refused = bind_error(candidate)
            if refused is None:
                return candidate, ""
            problems.append(f"{candidate} cannot be listened on: {_words(refused)}")
    return None, "; ".join(dict.fromkeys(problems)) or "it resolves to no address"


def meeting_address(address: str | None) -> str:
    """The numeric loopback address a single-node job's hosted store listens on and its
    ranks dial (:func:`local_meeting`); :func:`check_launch` refused the others already."""
    if not address or address == DEFAULT_ADDRESS:
        return DEFAULT_ADDRESS
    meeting, why = local_meeting(address)
    if meeting is None:
        raise MisconfigurationError(_not_here(address, why))
    return meeting


def _not_here(address: str, why: str) -> str:
    return (
        f"environment variable MASTER_ADDR={address!r} is not an address of this machine "
        f"({why}), yet every process of this single-node job runs here, so they could not "
        f"meet there (each would wait {INIT_TIMEOUT} and fail). Unset MASTER_ADDR (the job "
        "meets on 127.0.0.1), or set it to a loopback address such as 127.0.0.1 or ::1; for a "
        "job of several nodes, set num_nodes and MASTER_ADDR to node 0's address."
    )


def single_node_here(selection: Any) -> bool:
    """Whether this process starts every process of the job, on this machine."""
    return not selection.processes_created_outside and selection.num_nodes == 1


def port_error(port: int) -> OSError | None:
    """Why rank 0 could not listen on ``port`` (on every interface, with ``SO_REUSEADDR``, as
    torch's ``TCPStore`` does), or ``None`` when it is free. The probe closes at once."""
    try:
        if socket.has_dualstack_ipv6():
            server = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            server = socket.create_server(("", port))
    except OSError as error:
        return error
    server.close()
    return None


def check_master_port(selection: Any, needs_rendezvous: bool) -> None:
    """Refuse a ``MASTER_PORT`` that rank 0 of this job could not listen on (in use, or
    not permitted), before any process starts: otherwise the workers start and the job
    fails seconds later with ``EADDRINUSE``.

    Only where rank 0 runs on this machine and cardcage starts it (node 0 of a job launched
    here): under torchrun or SLURM the port is the launcher's store, already listening."""
    port = selection.master_port
    if (
        not needs_rendezvous
        or selection.world_size <= 1
        or port is None
        or selection.processes_created_outside
        or selection.node_rank != 0
    ):
        return
    error = port_error(int(port))
    if error is None:
        return
    in_use = error.errno == errno.EADDRINUSE
    what = "is already in use on this machine" if in_use else "cannot be listened on"
    raise MisconfigurationError(
        f"environment variable MASTER_PORT={port} {what} ({_words(error)}), and rank 0 of this "
        f"job would listen on it. Unset MASTER_PORT (on one node cardcage then picks a free "
        "port), or set it to a free port"
        + (" (another job, or a process left from one, holds this one)." if in_use else ".")
    )


def check_launch(selection: Any, needs_rendezvous: bool) -> None:
    """Everything a launch on this machine needs that can be checked in the process that
    called ``fit``, before any process, port or CUDA context exists: the rendezvous address
    (:func:`check_master_address`) and port (:func:`check_master_port`), and the number of
    processes this machine can start (:func:`cardcage.config.flags.check_process_count`)."""
    check_master_address(selection, needs_rendezvous)
    check_master_port(selection, needs_rendezvous)
    if not selection.processes_created_outside and selection.num_processes > 1:
        flags = getattr(selection, "flags", None)
        named = flags is not None and flags.num_processes == selection.num_processes
        check_process_count(selection.num_processes, "num_processes" if named else "")


def check_master_address(selection: Any, needs_rendezvous: bool) -> None:
    """Refuse a rendezvous host that does not resolve, in the process that called ``fit``,
    before any process or port exists (a rank would otherwise wait for the others until
    ``CARDCAGE_INIT_TIMEOUT``, the cause unnamed).

    Only a job of several processes that meet through ``MASTER_ADDR`` is checked, and only
    an address that was given (``MASTER_ADDR``) or that a cluster environment derived (the
    first host of the SLURM node list); the default loopback address is never looked up.
    When every rank runs here (one node, started by cardcage), the address must also be this
    machine's (:func:`local_meeting`: a bind, no packet sent). Whether something listens
    there is the rendezvous's to find out.
    """
    if not needs_rendezvous or selection.world_size <= 1:
        return
    given = os.environ.get("MASTER_ADDR", "").strip()
    address = given or (selection.master_address or "").strip()
    if not address or address == DEFAULT_ADDRESS:
        return
    error = resolve(address)
    if error is None:
        if single_node_here(selection):
            meeting, why = local_meeting(address)
            if meeting is None:
                raise MisconfigurationError(_not_here(address, why))
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
