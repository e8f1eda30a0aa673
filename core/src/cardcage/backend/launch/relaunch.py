"""Script relaunch (``ddp``): this process trains as local rank 0 and re-runs the user's
script once per extra local rank, as Lightning 1.0 did; the children run under a
:class:`~cardcage.backend.launch.supervisor.Supervisor`.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import sys

from cardcage.backend.launch import tempdirs
from cardcage.backend.launch.error_files import ERROR_FILE
from cardcage.backend.launch.rendezvous import (
    HOSTED_STORE,
    host_store,
    hosted_store,
    meeting_address,
    release_store,
)
from cardcage.backend.launch.supervisor import Child, Supervisor, set_parent_death_signal
from cardcage.backend.launch.watchdog import HEARTBEAT, Watch
from cardcage.environments import inherited
from cardcage.errors import MisconfigurationError

log = logging.getLogger("cardcage")

#: The children's error files and progress counts: + <pid>.<start>@<host>-<random> (tempdirs)
ERRORS_PREFIX = "cardcage-errors-"

_relaunched: dict[str, Supervisor] = {}
#: What the variables that relaunch_script set in this process were before (None: unset).
_environ_before: dict[str, str | None] = {}


def current_supervisor() -> Supervisor | None:
    """The supervisor of the processes this script already relaunched, if any."""
    return _relaunched.get("supervisor")


def forget() -> None:
    """Undo :func:`relaunch_script` after its children were stopped, so that the next
    ``fit`` relaunches afresh (a restart): its variables, its supervisor, its store."""
    supervisor = _relaunched.pop("supervisor", None)
    if supervisor is not None:
        supervisor.stopping.set()
    for key, value in _environ_before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _environ_before.clear()
    release_store()


def script_command() -> list[str]:
    """How to run the user's script again: ``python script.py args`` or ``python -m mod``."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name not in ("__main__", None):
        return [sys.executable, "-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]]
    script = sys.argv[0] if sys.argv else ""
    if not script or script == "-c" or not os.path.exists(script):
        raise MisconfigurationError(
            "distributed_backend='ddp' starts its processes by running your script again, "
            f"but this process has no script (sys.argv[0]={script!r}: an interactive session, "
            "a notebook or python -c). Use distributed_backend='ddp_spawn' there, or run a "
            "script."
        )
    return [sys.executable, os.path.abspath(script), *sys.argv[1:]]


def relaunch_script(
    *,
    node_rank: int,
    processes_per_node: int,
    num_nodes: int,
    master_address: str,
    master_port: int | None,
    gpu_ids: list[int] | None,
) -> Supervisor:
    """Start local ranks 1..n-1 of this node by re-running the script; this process is 0.

    Afterwards this process's environment says it is local rank 0 of a launched job, so a
    second ``fit`` (or a new Trainer) in the script joins the same processes instead of
    launching again.
    """
    import subprocess

    if "supervisor" in _relaunched:
        return _relaunched["supervisor"]
    world_size = processes_per_node * num_nodes
    base_rank = node_rank * processes_per_node
    env = dict(os.environ)
    command = script_command()
    hosted = master_port is None
    if hosted:
        if num_nodes > 1:
            raise MisconfigurationError(
                f"num_nodes={num_nodes} launched by hand needs MASTER_PORT (and MASTER_ADDR) "
                "set to the same values on every node. Set them, or launch with torchrun/srun."
            )
        master_address = meeting_address(master_address)  # a loopback address: ranks dial it
        store = host_store(world_size, master_address)
        master_port = int(store.port)
        env[HOSTED_STORE] = "1"
    errors = tempdirs.make(ERRORS_PREFIX)  # private; a SIGKILLed launcher's are removed
    atexit.register(shutil.rmtree, errors, True)  # the children's error files, once read
    # This process starts every rank (one node): it watches their progress too.
    watch = Watch(errors, world_size, {base_rank: os.getpid()}) if hosted else None
    if watch is not None:
        env[HEARTBEAT] = str(errors)
    env.update(
        {
            "MASTER_ADDR": master_address,
            "MASTER_PORT": str(master_port),
            "WORLD_SIZE": str(world_size),
            "NODE_RANK": str(node_rank),
            "GROUP_RANK": str(node_rank),
            "LOCAL_WORLD_SIZE": str(processes_per_node),
        }
    )
    if gpu_ids:
        env["CARDCAGE_GPUS"] = ",".join(str(i) for i in gpu_ids)
    children = []
    for local_rank in range(1, processes_per_node):
        child_env = {
            **inherited.for_child(dict(env)),  # the child marks itself a rank
            "LOCAL_RANK": str(local_rank),
            "RANK": str(base_rank + local_rank),
            ERROR_FILE: str(errors / f"rank-{base_rank + local_rank}.txt"),
        }
        process = subprocess.Popen(
            command,
            env=child_env,
            cwd=os.getcwd(),
            preexec_fn=_child_preexec,
        )
        children.append(
            Child(
                base_rank + local_rank,
                process.pid,
                process.poll,
                errors / f"rank-{base_rank + local_rank}.txt",
            )
        )
    # This process is local rank 0 from now on: a later fit joins these processes.
    ours = {k for k, v in env.items() if os.environ.get(k) != v} | {"LOCAL_RANK", "RANK"}
    _environ_before.clear()
    _environ_before.update({k: os.environ.get(k) for k in ours})
    os.environ.update(env)
    os.environ.update({"LOCAL_RANK": "0", "RANK": str(base_rank)})
    supervisor = Supervisor(
        children,
        store=hosted_store() if hosted else None,
        world_size=world_size if hosted else 0,
        watch=watch,
    )
    _relaunched["supervisor"] = supervisor
    log.info(
        "cardcage: started %d process(es) on node %d by re-running %s",
        len(children),
        node_rank,
        " ".join(command),
    )
    return supervisor


def _child_preexec() -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, [])  # whatever mask the launching thread had
    set_parent_death_signal()
