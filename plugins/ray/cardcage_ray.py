"""The ray backends: the training ranks as Ray actors, on a Ray cluster or a Ray of the job's own.

``ray`` trains as ``ddp`` does (DistributedDataParallel, one rank per actor) and ``ray_fsdp``
as ``fsdp`` does (FSDP2 shards), in actors that a placement group puts on ``num_nodes``
nodes. The caller joins the cluster that ``RAY_ADDRESS`` names (or a Ray it initialized
itself); with neither, it starts a local Ray for the job and stops it when ``fit`` returns.
The job goes to the actors pickled (cloudpickle: they do not run the caller's script), and
rank 0's trained state comes back into the caller, as after ``ddp_spawn``. Selected by name
only. Written only against ``cardcage.sdk``; discovery never imports ray.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from cardcage.sdk import (
    HEARTBEAT,
    HOSTED_STORE,
    Accelerator,
    Availability,
    DistributedAccelerator,
    Launcher,
    MisconfigurationError,
    RankFailedError,
    Reaper,
    Resolution,
    SelectionContext,
    ShardedAccelerator,
    TrainerProtocol,
    Watch,
    WorkerLauncher,
    distributed_availability,
    hookimpl,
    host_store,
    init_timeout,
    make_temp_folder,
    release_store,
    run_worker,
)

INSTALL = 'pip install "cardcage-ray" (it brings ray), or pip install "ray>=2.9"'
#: The variables of the caller that the actors get: cardcage's own (where step checkpoints
#: go, the run, the restart, the timeouts, a backend's settings) and ``PL_GLOBAL_SEED``
#: (``seed_everything()``'s). Ray starts actors with the environment of its node, not the
#: caller's.
PASSED_PREFIXES = ("CARDCAGE_", "PL_GLOBAL_SEED")
#: After the first failure, how long the others have to report theirs: a rank whose actor
#: died within it is the cause, though its peers' errors (the connection it closed) came
#: first.
SETTLE_S = 1.0
#: How often the launcher looks at the ranks' progress while it waits for them.
WATCH_S = 1.0
#: A local Ray's folder: ``<RAY_TMPDIR or the temporary folder>/cardcage-ray-<random>``.
SESSION_PREFIX = "cardcage-ray-"
#: The longest path that folder may have: Ray's sockets go 66 characters deeper, and a
#: Unix socket's path is limited to 107.
MAX_TEMP_DIR = 41


# -- the cluster ----------------------------------------------------------------------------


def _ray() -> Any:
    import ray

    return ray


@contextlib.contextmanager
def ray_for_the_job(backend: str, num_nodes: int, num_cpus: int) -> Iterator[None]:
    """Ray, for one ``fit``: the one this process initialized, else the cluster
    ``RAY_ADDRESS`` names (left as it was), else a local Ray of ``num_cpus`` started here and
    stopped at the end (with every process it started)."""
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if not address and "ray" not in sys.modules:
        # A Ray started here listens on loopback only, as a job's private cluster should
        # (else it takes the machine's outward address); read when ray is first imported.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = _ray()
    if ray.is_initialized():
        yield
        return
    if not address:
        os.environ.pop("RAY_ADDRESS", None)  # set but empty: Ray would read it as an address
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        if num_nodes > 1:
            raise MisconfigurationError(
                f"distributed_backend={backend!r} with num_nodes={num_nodes} needs a Ray "
                "cluster of that many nodes, but neither RAY_ADDRESS nor an initialized ray "
                "names one, and a local Ray has one node. Start the cluster (`ray start "
                "--head` on one machine, `ray start --address=HEAD:6379` on the others) and "
                "set RAY_ADDRESS, or set num_nodes=1."
            )
        # Ray's session folder and every process of this Ray (its raylet, workers and
        # agents, which start in sessions of their own) go with the job, even when this
        # process is SIGKILLed: a reaper holds the folder's name and kills what carries it.
        # Unix socket paths must stay under 108 characters (session_<date>_<pid>/sockets/
        # plasma_store under the folder): a deep TMPDIR (pytest's) falls back to /tmp.
        root = os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()
        if len(root) + len(SESSION_PREFIX) + 9 > MAX_TEMP_DIR:
            root = "/tmp"
        folder = make_temp_folder(SESSION_PREFIX, root)
        reaper = Reaper(folder)
        try:
            with reaper.marking():
                ray.init(
                    address="local",  # a Ray of its own, even where this machine runs one
                    num_cpus=num_cpus,
                    include_dashboard=False,
                    log_to_driver=True,
                    _temp_dir=str(folder),
                )
            try:
                yield
            finally:
                ray.shutdown()
        finally:
            reaper.finish()  # what outlived ray.shutdown() is killed, the folder removed
        return
    try:
        yield
    finally:
        ray.shutdown()  # a cluster's processes are only left


# -- in each actor --------------------------------------------------------------------------


def _machine() -> str:
    """This machine: its host name and boot (the simulated nodes of one machine share it)."""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{socket.gethostname()}/{boot}"
    return socket.gethostname()


class Rank:
    """One training rank, as a Ray actor (``ray.remote`` makes the actor class)."""

    def place(self) -> tuple[str, str, int]:
        """Where this actor runs: its node's address, its machine, its pid."""
        ray = _ray()
        return ray.util.get_node_ip_address(), _machine(), os.getpid()

    def host_store(self, world_size: int, address: str) -> int:
        """Host the process group's store in this actor (global rank 0's), listening on
        ``address`` alone (loopback for a job of one node, the node's address otherwise; a
        port picked by ``bind`` on every interface let the whole network in): its port."""
        return int(host_store(world_size, address).port)

    def train(
        self, payload: bytes, env: dict[str, str], path: list[str], cwd: str, folder: str
    ) -> tuple[str, float, Any]:
        """Train this rank: ``("done", time, results)`` (global rank 0's results file as
        bytes, else None), or ``("failed", time, traceback)``.

        Its files go to a folder of its own inside the launcher's ``folder`` when that is on
        this machine (the launcher removes it, even after this actor was killed), else to a
        temporary folder of this node."""
        os.environ.update(env)
        sys.path.extend(entry for entry in path if entry not in sys.path)
        if os.path.isdir(cwd):
            os.chdir(cwd)  # the caller's relative paths (default_root_dir) mean the same here
        if os.path.isdir(folder):
            own = Path(folder, f"rank-{env['RANK']}")
            own.mkdir()
        else:
            own = Path(tempfile.mkdtemp(prefix="cardcage-ray-"))
        try:
            run_worker(payload, own)
            results = own / "results.pt"
            data = results.read_bytes() if env["RANK"] == "0" and results.exists() else None
            return "done", time.time(), data
        except BaseException as error:
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            print(text, file=sys.stderr, flush=True)
            return "failed", time.time(), text
        finally:
            shutil.rmtree(own, ignore_errors=True)
            with contextlib.suppress(Exception):
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group()
            release_store()


# -- the launcher ---------------------------------------------------------------------------


def store_address(num_nodes: int, master: str) -> str:
    """Where rank 0's store listens (and the ranks dial): loopback for a job of one node
    (every rank is on rank 0's node), else the address of rank 0's node. Never every
    interface."""
    return "127.0.0.1" if num_nodes == 1 else master


@dataclass
class Actor:
    rank: int
    node_rank: int
    handle: Any
    address: str = ""
    machine: str = ""
    pid: int = 0

    def where(self) -> str:
        return f"Ray node {self.node_rank} ({self.address}, actor pid {self.pid})"


class RayLauncher(WorkerLauncher):
    """``num_nodes`` times ``num_processes`` actors in a placement group, one rank each. The job
    goes by cloudpickle; global rank 0's results come back through Ray's object store."""

    pickle_by_value = True
    unpicklable_hint = "or define it in a module the Ray workers can import"

    def start_workers(self, payload: bytes, folder: Path) -> None:
        ray = _ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        selection = self.accelerator.selection
        nprocs, num_nodes = selection.num_processes, selection.num_nodes
        gpus = len(selection.gpu_ids or ())
        world = nprocs * num_nodes
        # One bundle per node, on distinct nodes: the ranks of a node share it.
        bundle = {"CPU": float(nprocs), **({"GPU": float(gpus)} if gpus else {})}
        group = placement_group(
            [bundle] * num_nodes, strategy="STRICT_SPREAD" if num_nodes > 1 else "STRICT_PACK"
        )
        passed = {k: v for k, v in os.environ.items() if k.startswith(PASSED_PREFIXES)}
        actors: list[Actor] = []
        try:
            self._wait_for_room(ray, group, bundle, num_nodes)
            remote = ray.remote(Rank)
            for rank in range(world):
                node, _local = divmod(rank, nprocs)
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=node
                )
                handle = remote.options(
                    scheduling_strategy=strategy,
                    num_cpus=1,
                    num_gpus=1 if gpus else 0,
                    runtime_env={"env_vars": passed},  # in the process's own environment
                ).remote()
                actors.append(Actor(rank, node, handle))
            places = ray.get([a.handle.place.remote() for a in actors], timeout=init_timeout())
            for actor, (address, machine, pid) in zip(actors, places, strict=True):
                actor.address, actor.machine, actor.pid = address, machine, pid
            address = store_address(num_nodes, actors[0].address)
            hosting = actors[0].handle.host_store.remote(world, address)
            port = ray.get(hosting, timeout=init_timeout())
            self._run(ray, actors, payload, folder, address, port, nprocs)
        finally:
            for actor in actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor.handle, no_restart=True)
            with contextlib.suppress(Exception):
                remove_placement_group(group)

    def _wait_for_room(self, ray: Any, group: Any, bundle: dict[str, float], nodes: int) -> None:
        """Wait for the placement group; when the cluster has no room for it, say so."""
        try:
            ray.get(group.ready(), timeout=init_timeout())
        except ray.exceptions.GetTimeoutError:
            have = ray.cluster_resources()
            raise MisconfigurationError(
                f"distributed_backend={self.accelerator.selection.accelerator!r} asks the Ray "
                f"cluster for {nodes} node(s) with {bundle} each (num_nodes, num_processes, "
                f"gpus), but it has not placed them within {init_timeout():.0f}s: it has "
                f"{len(ray.nodes())} node(s) and {have}. Lower num_nodes or num_processes, or "
                "add nodes."
            ) from None

    def _run(
        self,
        ray: Any,
        actors: list[Actor],
        payload: bytes,
        folder: Path,
        address: str,
        port: int,
        nprocs: int,
    ) -> None:
        world = len(actors)
        here = _machine()
        # The watcher reads a file the ranks map: possible where every rank runs on this
        # machine. Elsewhere the process group's own timeout ends a stuck job.
        local = all(a.machine == here for a in actors)
        watch = Watch(folder, world, {a.rank: a.pid for a in actors}) if local else None
        loopback = all(a.address.startswith("127.") for a in actors)
        job = ray.put(payload)
        futures = {}
        for actor in actors:
            env = {
                "MASTER_ADDR": address,
                "MASTER_PORT": str(port),
                HOSTED_STORE: "1",  # rank 0's actor hosts it; the others dial it
                "WORLD_SIZE": str(world),
                "RANK": str(actor.rank),
                "LOCAL_RANK": str(actor.rank % nprocs),
                "LOCAL_WORLD_SIZE": str(nprocs),
                "NODE_RANK": str(actor.node_rank),
                "GROUP_RANK": str(actor.node_rank),
            }
            if loopback:
                env["GLOO_SOCKET_IFNAME"] = "lo"  # the nodes of one machine meet on loopback
            if watch is not None:
                env[HEARTBEAT] = str(folder)
            future = actor.handle.train.remote(job, env, list(sys.path), os.getcwd(), str(folder))
            futures[future] = actor
        results = self._wait(ray, futures, actors, watch)
        (folder / "results.pt").write_bytes(results)

    def _wait(
        self, ray: Any, futures: dict[Any, Actor], actors: list[Actor], watch: Watch | None
    ) -> bytes:
        """Global rank 0's results once every rank is done; the first failure, named."""
        pending = list(futures)
        outcomes: dict[int, tuple[str, float, Any]] = {}
        failed_at: float | None = None
        looked = time.monotonic()
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.2)
            for future in done:
                actor = futures[future]
                try:
                    outcomes[actor.rank] = ray.get(future)
                except ray.exceptions.RayActorError as error:
                    outcomes[actor.rank] = ("died", time.time(), str(error).strip())
                if outcomes[actor.rank][0] != "done" and failed_at is None:
                    failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at >= SETTLE_S:
                break
            now = time.monotonic()
            if watch is not None and failed_at is None and now - looked >= WATCH_S:
                looked = now
                stuck = watch.check(now)
                if stuck is not None:
                    rank, reason, stack = stuck
                    raise RankFailedError(rank, None, stack, f"{reason} on {actors[rank].where()}")
        if failed_at is not None:
            raise self._failure(actors, outcomes)
        data = outcomes[0][2]
        if data is None:
            raise RuntimeError("rank 0 finished without handing its results back")
        return bytes(data)

    def _failure(
        self, actors: list[Actor], outcomes: dict[int, tuple[str, float, Any]]
    ) -> RankFailedError:
        """The first failure: a rank whose actor died (killed, out of memory: never a
        consequence of another's error), else the earliest traceback."""
        died = sorted(rank for rank, outcome in outcomes.items() if outcome[0] == "died")
        if died:
            rank = died[0]
            reason = f"died on {actors[rank].where()}: its actor process ended"
            return RankFailedError(rank, None, outcomes[rank][2], reason)
        failed = [(o[1], rank) for rank, o in outcomes.items() if o[0] == "failed"]
        rank = min(failed)[1]
        reason = f"raised an exception on {actors[rank].where()}"
        return RankFailedError(rank, None, outcomes[rank][2], reason)


# -- the backends ---------------------------------------------------------------------------


class OnRay:
    """What both backends add to their strategy: Ray for the job, the actors, their devices."""

    multi_node: ClassVar[bool] = True
    launcher: ClassVar[type[Launcher]] = RayLauncher
    selection: Any

    @classmethod
    def availability(cls, ctx: SelectionContext) -> Availability:
        """Ray installed (looked up, not imported), torch.distributed, and what the
        strategy itself needs (FSDP2 for ``ray_fsdp``)."""
        if importlib.util.find_spec("ray") is None:
            return Availability(False, "ray is not installed", INSTALL)
        strategy: Availability = super().availability(ctx)  # type: ignore[misc]
        for found in (distributed_availability(), strategy):
            if not found:
                return found
        return Availability(True, f"Ray {importlib.metadata.version('ray')}")

    @classmethod
    def resolve(cls, ctx: SelectionContext) -> Resolution:
        """Refuse processes that a launcher other than Ray made: each would start a job."""
        if ctx.processes_created_outside:
            name = ctx.requested_as or cls.name  # type: ignore[attr-defined]
            size = ctx.cluster.world_size()
            raise MisconfigurationError(
                f"distributed_backend={name!r} under {ctx.cluster.name} ({size} processes): "
                f"the Ray backends start their ranks as Ray actors, so each of the {size} "
                f"processes would start a job of its own. Run the script once (`python "
                f"train.py`) with num_processes and num_nodes, or use distributed_backend="
                f"'ddp' under {ctx.cluster.name}."
            )
        return super().resolve(ctx)  # type: ignore[misc,no-any-return]

    def train(self, trainer: TrainerProtocol) -> Any:
        """The job on Ray: connected (or started) once for every attempt of ``max_restarts``."""
        selection = self.selection
        world = selection.num_processes * selection.num_nodes
        cpus = max(os.cpu_count() or 1, world)
        with ray_for_the_job(selection.accelerator, selection.num_nodes, cpus):
            return super().train(trainer)  # type: ignore[misc]

    @property
    def hands_back_results(self) -> bool:
        """Global rank 0 alone: its results come back through Ray's object store, whatever
        node it is on (a sharded backend gathers the full state there only)."""
        return self.global_rank == 0  # type: ignore[attr-defined,no-any-return]

    @property
    def hand_back_ranks(self) -> list[int]:
        return [0]

    def device_for_rank(self) -> torch.device:
        """Ray shows each actor the one GPU it was given (``CUDA_VISIBLE_DEVICES``)."""
        return torch.device("cuda", 0) if self.selection.gpu_ids else torch.device("cpu")


class RayAccelerator(OnRay, DistributedAccelerator):  # type: ignore[misc]
    """DistributedDataParallel, one rank per Ray actor."""

    name = "ray"
    rules = ()


class RayFSDPAccelerator(OnRay, ShardedAccelerator):  # type: ignore[misc]
    """FSDP2 (``fully_shard``), one rank per Ray actor."""

    name = "ray_fsdp"
    rules = ()


@hookimpl
def cardcage_accelerators() -> list[type[Accelerator]]:
    return [RayAccelerator, RayFSDPAccelerator]
