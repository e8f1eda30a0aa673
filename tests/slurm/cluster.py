"""A private two-node SLURM cluster on this machine, for tests/slurm and for trying things out.

It starts a munged, a slurmctld and two slurmd (nodes ``n1`` and ``n2``, both on this host,
with 4 CPUs each through ``SlurmdParameters=config_overrides``) under one folder, waits until
both nodes are idle, and stops exactly the daemons it started, by their recorded PIDs. The
system's SLURM and munge (if any) are left alone: the daemons use their own ports (16817 and
up, or the next free ones), their own munge socket and key, and a state folder that is wiped
on every start.

The Debian packages are installed when missing (``apt-get install --no-install-recommends
slurmctld slurmd slurm-client munge``), only when running as root; otherwise
:class:`Unavailable` says why, and the tests skip with that reason.

The nodes are called ``n1`` and ``n2``, so that a job's ``SLURM_NODELIST`` is ``n[1-2]`` as on
a real cluster. Tasks must be able to resolve those names (the rendezvous address of a job
is the first host of its node list): the slurmd daemons run in a private mount namespace
whose ``/etc/hosts`` maps both names to 127.0.0.1, so the machine's own file is untouched.

From a shell::

    python -m tests.slurm.cluster start [--base DIR]   # prints the SLURM_CONF to export
    export SLURM_CONF=DIR/slurm.conf
    srun -N2 --ntasks-per-node=2 hostname
    python -m tests.slurm.cluster stop --base DIR

Every client call made through :class:`Cluster` has a timeout, and ``srun`` is run with
``--immediate`` so that a request the cluster cannot satisfy fails instead of waiting forever.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

NODES = ("n1", "n2")
CPUS_PER_NODE = 4
FIRST_PORT = 16817
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "sinfo", "squeue", "scontrol", "scancel")
STATE_FILE = "cluster.json"
TERMINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "PREEMPTED",
    }
)
SBIN = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")


class Unavailable(RuntimeError):
    """SLURM cannot be started here; the message says why (tests skip with it)."""


# -- packages ---------------------------------------------------------------------------------


def _path_with_sbin(env: Mapping[str, str] | None = None) -> str:
    path = (env or os.environ).get("PATH", "")
    parts = path.split(os.pathsep) if path else []
    return os.pathsep.join([*parts, *(p for p in SBIN if p not in parts)])


def _which(name: str) -> str | None:
    return shutil.which(name, path=_path_with_sbin())


def missing_programs() -> list[str]:
    return [name for name in (*DAEMONS, *CLIENTS) if _which(name) is None]


def ensure_packages(log: list[str] | None = None) -> None:
    """Install the Debian packages when a program is missing (root only), else raise."""
    missing = missing_programs()
    if not missing:
        return
    if not sys.platform.startswith("linux"):
        raise Unavailable(f"SLURM tests need Linux (missing: {', '.join(missing)})")
    if os.geteuid() != 0:
        raise Unavailable(
            f"SLURM is not installed (missing: {', '.join(missing)}) and this is not root, so "
            f"it cannot be installed here: apt-get install {' '.join(PACKAGES)}"
        )
    apt = _which("apt-get")
    if apt is None:
        raise Unavailable(f"SLURM is not installed (missing: {', '.join(missing)}), no apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    commands = [
        [apt, "update", "-q"],
        [apt, "install", "-y", "-q", "--no-install-recommends", *PACKAGES],
    ]
    for command in commands:
        started = time.monotonic()
        try:
            done = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=900, check=False
            )
        except subprocess.TimeoutExpired:
            raise Unavailable(f"`{' '.join(command)}` timed out") from None
        if log is not None:
            log.append(
                f"{' '.join(command)}: rc {done.returncode}, {time.monotonic() - started:.1f}s"
            )
        if done.returncode != 0:
            raise Unavailable(
                f"`{' '.join(command)}` failed with status {done.returncode}: "
                f"{(done.stderr or done.stdout)[-2000:]}"
            )
    missing = missing_programs()
    if missing:
        raise Unavailable(f"installed {' '.join(PACKAGES)}, still missing {', '.join(missing)}")


# -- configuration ----------------------------------------------------------------------------


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_port_block(count: int, first: int = FIRST_PORT, attempts: int = 200) -> int:
    """The first port of ``count`` consecutive free ports at or after ``first``."""
    port = first
    for _ in range(attempts):
        if all(_port_free(port + i) for i in range(count)):
            return port
        port += count
    raise Unavailable(f"no {count} consecutive free TCP ports from {first}")


def slurm_conf(base: Path, ctld_port: int, first_job_id: int) -> str:
    """The configuration: linuxproc process tracking, no cgroups, no accounting, 2 nodes."""
    lines = [
        "ClusterName=cardcagetest",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # A requeued job may start again once its credentials expired: 10 s here, not 120.
        f"AuthInfo=socket={base}/munge/munge.socket.2,cred_expire=10",
        f"StateSaveLocation={base}/state",
        f"SlurmdSpoolDir={base}/spool/%n",
        f"SlurmctldPidFile={base}/run/slurmctld.pid",
        f"SlurmdPidFile={base}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={base}/log/slurmctld.log",
        f"SlurmdLogFile={base}/log/slurmd-%n.log",
        # The default, proctrack/cgroup, fails every step here (no freezer cgroup), and srun
        # still exits 0: see research/slurm-on-one-machine.md.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        # Schedule every 2 s (defaults: 60 s main loop, 30 s backfill), so that a requeued
        # job starts again soon after it becomes eligible.
        "SchedulerParameters=sched_interval=2,bf_interval=2",
        "ReturnToService=2",
        "JobRequeue=1",
        # Job ids decide the default rendezvous port (15000 + last 4 digits): start at a
        # random id so that two of these clusters on one machine do not share ports.
        f"FirstJobId={first_job_id}",
        "KillWait=5",
        "MinJobAge=600",
        "InactiveLimit=0",
        "SlurmdParameters=config_overrides",
    ]
    for index, node in enumerate(NODES):
        lines.append(
            f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 "
            f"Port={ctld_port + 1 + index} CPUs={CPUS_PER_NODE} State=UNKNOWN"
        )
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


# -- the cluster ------------------------------------------------------------------------------


def _set_parent_death_signal() -> None:
    with contextlib.suppress(OSError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as gone; reap it.
    with contextlib.suppress(ChildProcessError, OSError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    status = Path(f"/proc/{pid}/status")
    with contextlib.suppress(OSError):
        return "\nState:\tZ" not in status.read_text()
    return True


@dataclass
class Cluster:
    """A running private cluster; ``env`` is what every client call needs (``SLURM_CONF``)."""

    base: Path
    ctld_port: int
    first_job_id: int
    pids: dict[str, int] = field(default_factory=dict)
    hosts_mode: str = "namespace"
    started_s: float = 0.0

    @property
    def conf(self) -> Path:
        return self.base / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = _path_with_sbin(env)
        for name in list(env):  # a test run inside an allocation must not leak into jobs
            if name.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_")) and name != "SLURM_CONF":
                del env[name]
        return env

    # -- clients --------------------------------------------------------------------------

    def run(
        self,
        command: Sequence[str],
        *,
        timeout: float,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Run a client command with a timeout; ``env`` adds to :attr:`env`."""
        full_env = {**self.env, **(env or {})}
        try:
            done = subprocess.run(
                list(command),
                env=full_env,
                cwd=cwd,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as error:
            out = error.stdout.decode() if isinstance(error.stdout, bytes) else error.stdout
            err = error.stderr.decode() if isinstance(error.stderr, bytes) else error.stderr
            raise AssertionError(
                f"`{' '.join(command)}` did not finish within {timeout}s\n"
                f"--- stdout ---\n{out or ''}\n--- stderr ---\n{err or ''}"
            ) from None
        if check and done.returncode != 0:
            raise AssertionError(
                f"`{' '.join(command)}` exited {done.returncode}\n--- stdout ---\n{done.stdout}"
                f"\n--- stderr ---\n{done.stderr}"
            )
        return done

    def srun(
        self, *args: str, timeout: float = 120, immediate: int = 10, **kwargs: object
    ) -> subprocess.CompletedProcess[str]:
        """``srun --immediate=N args`` with a timeout (a step that cannot start fails)."""
        return self.run(["srun", f"--immediate={immediate}", *args], timeout=timeout, **kwargs)  # type: ignore[arg-type]

    def sbatch(
        self,
        *args: str,
        cwd: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> int:
        """Submit a batch job (``env`` adds to its environment); its id."""
        done = self.run(["sbatch", "--parsable", *args], timeout=30, cwd=cwd, env=env, check=True)
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a mapping (empty once the controller forgot the job)."""
        done = self.run(["scontrol", "show", "job", "-o", str(job_id)], timeout=30)
        if done.returncode != 0:
            return {}
        fields: dict[str, str] = {}
        for match in re.finditer(r"(\w+)=(\S*)", done.stdout):
            fields.setdefault(match.group(1), match.group(2))
        return fields

    def job_state(self, job_id: int) -> str:
        return self.job(job_id).get("JobState", "UNKNOWN")

    def wait_state(
        self, job_id: int, states: Sequence[str] | frozenset[str], deadline_s: float
    ) -> str:
        """Poll until the job is in one of ``states``; raise with its record at the deadline."""
        deadline = time.monotonic() + deadline_s
        state = ""
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in states:
                return state
            time.sleep(0.25)
        self.run(["scancel", str(job_id)], timeout=30)
        raise AssertionError(
            f"job {job_id} still {state} after {deadline_s}s (wanted {sorted(states)}); "
            f"cancelled. Record: {self.job(job_id)}"
        )

    def wait_done(self, job_id: int, deadline_s: float) -> str:
        """Poll until the job ends (COMPLETED, FAILED, ...); its final state."""
        return self.wait_state(job_id, TERMINAL_STATES, deadline_s)

    def idle_nodes(self) -> set[str]:
        done = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=15)
        idle = set()
        for line in done.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1] == "idle":
                idle.add(parts[0])
        return idle

    # -- daemons --------------------------------------------------------------------------

    def _spawn(self, name: str, command: list[str], tie_to_parent: bool) -> None:
        log = open(self.base / "log" / f"{name}.out", "wb")  # noqa: SIM115 - the daemon keeps it
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.base,
            start_new_session=True,
            preexec_fn=_set_parent_death_signal if tie_to_parent else None,
        )
        log.close()
        self.pids[name] = process.pid
        self.save()

    def save(self) -> None:
        state = {
            "base": str(self.base),
            "ctld_port": self.ctld_port,
            "first_job_id": self.first_job_id,
            "pids": self.pids,
            "hosts_mode": self.hosts_mode,
        }
        (self.base / STATE_FILE).write_text(json.dumps(state, indent=1))

    @classmethod
    def load(cls, base: str | os.PathLike[str]) -> Cluster:
        state = json.loads((Path(base) / STATE_FILE).read_text())
        return cls(
            Path(state["base"]),
            int(state["ctld_port"]),
            int(state["first_job_id"]),
            {k: int(v) for k, v in state["pids"].items()},
            state.get("hosts_mode", "namespace"),
        )

    def stop(self, timeout: float = 15.0) -> list[str]:
        """Cancel the jobs left, SIGTERM each recorded daemon (slurmd first), SIGKILL what is
        left, and what the daemons started (job steps) if it outlived them; what was stopped.

        A daemon's PID is signalled only while its command line still names this cluster's
        folder, and a step's only while its start time is the one seen before, so a recycled
        PID is never touched.
        """
        self._cancel_jobs(timeout)
        order = sorted(self.pids, key=lambda n: (not n.startswith("slurmd"), n == "munged"))
        children = _descendants([self.pids[n] for n in order if n.startswith("slurmd")])
        stopped = []
        for name in order:
            pid = self.pids[name]
            if _alive(pid) and str(self.base) in _cmdline(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
                stopped.append(name)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(_alive(self.pids[n]) for n in stopped):
            time.sleep(0.05)
        for name in stopped:
            pid = self.pids[name]
            if _alive(pid) and str(self.base) in _cmdline(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for pid, started in children.items():
            if _start_time(pid) == started and _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if self.hosts_mode == "etc-hosts":
            _remove_hosts_entry(self.base)
        self.pids = {}
        with contextlib.suppress(OSError):
            self.save()
        return stopped

    def _cancel_jobs(self, timeout: float) -> None:
        slurmctld = self.pids.get("slurmctld", -1)
        if not (_alive(slurmctld) and str(self.base) in _cmdline(slurmctld)):
            return
        with contextlib.suppress(AssertionError):
            jobs = self.run(["squeue", "-h", "-o", "%i"], timeout=15).stdout.split()
            if not jobs:
                return
            self.run(["scancel", *jobs], timeout=15)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if not self.run(["squeue", "-h", "-o", "%i"], timeout=15).stdout.split():
                    return
                time.sleep(0.2)


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _descendants(roots: Sequence[int]) -> dict[int, str]:
    """Every live descendant of ``roots``: PID -> start time (to recognise it later)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                parents[int(entry.name)] = int(stat[1])
    found: dict[int, str] = {}
    frontier = set(roots)
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - set(found)
        for pid in frontier:
            started = _start_time(pid)
            if started is not None:
                found[pid] = started
    return found


# -- node names -------------------------------------------------------------------------------

HOSTS_MARK = "# cardcage-slurm-test"


def _names_resolve() -> bool:
    try:
        return all(socket.gethostbyname(node) == "127.0.0.1" for node in NODES)
    except OSError:
        return False


def _namespace_works(hosts: Path) -> bool:
    unshare = _which("unshare")
    if unshare is None:
        return False
    probe = f"mount --bind {hosts} /etc/hosts && getent hosts {NODES[0]} | grep -q 127.0.0.1"
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        done = subprocess.run(
            [unshare, "--mount", "sh", "-c", probe], capture_output=True, timeout=10, check=False
        )
        return done.returncode == 0
    return False


def _add_hosts_entry(base: Path) -> None:
    line = f"127.0.0.1 {' '.join(NODES)} {HOSTS_MARK} {base}\n"
    with open("/etc/hosts", "a") as stream:
        stream.write(line)


def _remove_hosts_entry(base: Path) -> None:
    with contextlib.suppress(OSError):
        lines = Path("/etc/hosts").read_text().splitlines(keepends=True)
        kept = [line for line in lines if not (HOSTS_MARK in line and str(base) in line)]
        if kept != lines:
            Path("/etc/hosts").write_text("".join(kept))


# -- start / stop -----------------------------------------------------------------------------


def start(
    base: str | os.PathLike[str] | None = None,
    *,
    tie_to_parent: bool = False,
    ready_timeout: float = 60.0,
    install: bool = True,
) -> Cluster:
    """Start the cluster under ``base`` (a new temporary folder by default); wait for idle nodes.

    ``tie_to_parent``: the daemons get SIGTERM when this process dies (for a test session,
    so that an interrupted run leaves nothing behind). Raises :class:`Unavailable` when SLURM
    cannot run here.
    """
    if not sys.platform.startswith("linux"):
        raise Unavailable("SLURM tests need Linux")
    if install:
        ensure_packages()
    elif missing_programs():
        raise Unavailable(f"SLURM programs missing: {', '.join(missing_programs())}")
    if os.geteuid() != 0:
        raise Unavailable("the private SLURM cluster runs its daemons as root; not root here")
    started = time.monotonic()
    folder = Path(base) if base is not None else Path(tempfile.mkdtemp(prefix="cardcage-slurm-"))
    folder = folder.resolve()
    for sub in ("state", "spool"):
        shutil.rmtree(folder / sub, ignore_errors=True)
    for sub in ("munge", "state", "spool", "log", "run"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    (folder / "munge").chmod(0o700)
    for node in NODES:
        (folder / "spool" / node).mkdir(exist_ok=True)
    ctld_port = free_port_block(1 + len(NODES))
    cluster = Cluster(folder, ctld_port, random.randrange(1000, 9000) * 10 + 1)
    cluster.conf.write_text(slurm_conf(folder, ctld_port, cluster.first_job_id))
    hosts = folder / "hosts"
    hosts.write_text(Path("/etc/hosts").read_text() + f"127.0.0.1 {' '.join(NODES)} {HOSTS_MARK}\n")
    if _names_resolve():
        cluster.hosts_mode = "resolves"
    elif _namespace_works(hosts):
        cluster.hosts_mode = "namespace"
    else:
        cluster.hosts_mode = "etc-hosts"
        _add_hosts_entry(folder)
    cluster.save()
    try:
        key = folder / "munge" / "munge.key"
        if not key.exists():
            subprocess.run(
                [_which("mungekey") or "mungekey", "--create", f"--keyfile={key}", "--bits=1024"],
                check=True,
                capture_output=True,
                timeout=30,
            )
        cluster._spawn(
            "munged",
            [
                _which("munged") or "munged",
                "-F",
                "--force",
                f"--socket={folder}/munge/munge.socket.2",
                f"--key-file={key}",
                f"--log-file={folder}/log/munged.log",
                f"--pid-file={folder}/run/munged.pid",
                f"--seed-file={folder}/munge/munged.seed",
            ],
            tie_to_parent,
        )
        _wait_for(lambda: (folder / "munge" / "munge.socket.2").exists(), 10, "munged socket")
        cluster._spawn(
            "slurmctld",
            [_which("slurmctld") or "slurmctld", "-D", "-i", "-f", str(cluster.conf)],
            tie_to_parent,
        )
        for node in NODES:
            command = [_which("slurmd") or "slurmd", "-D", "-f", str(cluster.conf), "-N", node]
            if cluster.hosts_mode == "namespace":
                # exec keeps the PID: unshare -> sh -> slurmd, all one process.
                command = [
                    _which("unshare") or "unshare",
                    "--mount",
                    "sh",
                    "-c",
                    f'mount --bind {hosts} /etc/hosts && exec "$@"',
                    "sh",
                    *command,
                ]
            cluster._spawn(f"slurmd-{node}", command, tie_to_parent)
        deadline = time.monotonic() + ready_timeout
        while cluster.idle_nodes() != set(NODES):
            dead = [n for n, pid in cluster.pids.items() if not _alive(pid)]
            if dead or time.monotonic() > deadline:
                what = f"died: {', '.join(dead)}" if dead else "nodes not idle"
                raise Unavailable(
                    f"the private SLURM cluster did not come up ({what} after "
                    f"{time.monotonic() - started:.0f}s); logs in {folder / 'log'}:\n"
                    + _tail_logs(folder)
                )
            time.sleep(0.1)
    except BaseException:
        cluster.stop()
        raise
    cluster.started_s = time.monotonic() - started
    return cluster


def _wait_for(condition: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise Unavailable(f"timed out waiting for {what}")


def _tail_logs(folder: Path, lines: int = 15) -> str:
    text = []
    for path in sorted((folder / "log").glob("*")):
        with contextlib.suppress(OSError):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            text.append(f"--- {path.name} ---\n" + "\n".join(tail))
    return "\n".join(text)


def stop(cluster: Cluster | str | os.PathLike[str]) -> list[str]:
    """Stop the daemons a :func:`start` recorded (a :class:`Cluster`, or its folder)."""
    if not isinstance(cluster, Cluster):
        cluster = Cluster.load(cluster)
    return cluster.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.slurm.cluster", description=__doc__)
    parser.add_argument("action", choices=("start", "stop", "status"))
    parser.add_argument("--base", help="the cluster's folder (start: default a new temp folder)")
    args = parser.parse_args(argv)
    try:
        if args.action == "start":
            cluster = start(args.base)
            print(f"started in {cluster.started_s:.1f}s; nodes {', '.join(NODES)} idle")
            print(f"export SLURM_CONF={cluster.conf}")
            print(f"stop with: python -m tests.slurm.cluster stop --base {cluster.base}")
            return 0
        if not args.base:
            parser.error("--base is required")
        if args.action == "stop":
            print("stopped:", ", ".join(stop(args.base)) or "nothing")
            return 0
        cluster = Cluster.load(args.base)
        alive = {n: p for n, p in cluster.pids.items() if _alive(p)}
        print(json.dumps({"base": str(cluster.base), "alive": alive}, indent=1))
        return 0 if alive else 1
    except Unavailable as error:
        print(f"cluster: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
