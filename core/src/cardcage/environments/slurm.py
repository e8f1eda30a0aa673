"""SLURM: node-list parsing and the cluster environment of a job step whose tasks train.

Detected (order 300, after horovodrun/mpirun and torchelastic) when SLURM manages the tasks.
The environment derives the rendezvous from the job (the first host of the node list, a port
from the job id) and requeues the job with ``scontrol requeue`` when
:mod:`cardcage.train.requeue` asks it to.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping

from cardcage.config.variables import REQUEUE_SIGNAL
from cardcage.environments.base import (
    DEFAULT_MASTER_ADDR,
    ClusterEnvironment,
    env_int,
    env_master_port,
    rank_in_range,
    require_int,
)

INTERACTIVE_SLURM_JOB_NAMES = ("bash", "interactive")
#: What to do about a SLURM rank variable out of range.
SLURM_FIX = (
    "SLURM sets these for each task of a job step: start the script with srun inside the "
    "allocation, and unset any left over from another job or set by hand."
)


def tasks_per_node(value: str) -> list[int] | None:
    """SLURM's compressed task counts: ``"2(x3),1"`` → ``[2, 2, 2, 1]``; ``None`` when
    ``value`` is not in that form."""
    counts: list[int] = []
    for piece in value.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", piece)
        if not match:
            return None
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts or None


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"n[3-5,7],m1"`` → ``"n3"``, ``"a01"`` → ``"a01"``."""
    depth, end = 0, len(nodelist)
    for index, char in enumerate(nodelist):
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            end = index
            break
    first = nodelist[:end].strip()
    match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", first)
    if not match:
        return first
    prefix, ranges, suffix = match.groups()
    start = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{start}{suffix}"


class SLURMEnvironment(ClusterEnvironment):
    """A SLURM job step whose tasks are the training processes.

    SLURM manages tasks when ``SLURM_NTASKS`` equals the world size the flags ask for and the
    job is not an interactive shell (``SLURM_JOB_NAME`` ``bash`` or ``interactive``).
    Lightning 1.0 compared against ``num_processes`` alone on the CPU, so a multi-node CPU
    job was never managed; here the comparison is with ``num_nodes`` x processes per node.
    """

    name = "slurm"
    order = 300
    creates_processes = True
    variables = (
        "SLURM_JOB_ID",
        "SLURM_JOB_NAME",
        "SLURM_NTASKS",
        "SLURM_NTASKS_PER_NODE",
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "SLURM_NODEID",
        "SLURM_NODELIST",
        "SLURM_JOB_NODELIST",
        "SLURM_RESTART_COUNT",
        "SLURM_SUBMIT_DIR",
        "MASTER_ADDR",
        "MASTER_PORT",
        REQUEUE_SIGNAL,
    )
    # sbatch --signal=USR1@90 sends it to every task 90 s before the time limit.
    requeue_signal_default = "SIGUSR1"

    @classmethod
    def detect(cls, env: Mapping[str, str], expected_world_size: int) -> bool:
        if "SLURM_NTASKS" not in env:
            return False
        if env.get("SLURM_JOB_NAME", "") in INTERACTIVE_SLURM_JOB_NAMES:
            return False
        return env_int(env, "SLURM_NTASKS") == expected_world_size

    @classmethod
    def note(cls, env: Mapping[str, str], expected_world_size: int) -> str | None:
        if "SLURM_NTASKS" not in env or cls.detect(env, expected_world_size):
            return None
        if env.get("SLURM_JOB_NAME", "") in INTERACTIVE_SLURM_JOB_NAMES:
            return (
                f"interactive SLURM job (SLURM_JOB_NAME={env['SLURM_JOB_NAME']!r}): cardcage "
                "starts its own processes."
            )
        return (
            f"SLURM_NTASKS={env['SLURM_NTASKS']} differs from the {expected_world_size} "
            "processes the flags ask for (num_nodes x processes per node), so SLURM is not "
            "managing tasks and cardcage starts its own processes. To let SLURM start them, "
            "set --ntasks-per-node to the processes per node."
        )

    def world_size(self) -> int:
        return require_int(self.env, "SLURM_NTASKS", 1)

    def global_rank(self) -> int:
        tasks = self.world_size()
        procid = require_int(self.env, "SLURM_PROCID", 0)
        return rank_in_range("SLURM_PROCID", procid, tasks, f"SLURM_NTASKS={tasks}", SLURM_FIX)

    def local_rank(self) -> int:
        localid = require_int(self.env, "SLURM_LOCALID", 0)
        size, against = self._tasks_here()
        return rank_in_range("SLURM_LOCALID", localid, size, against, SLURM_FIX)

    def node_rank(self) -> int:
        nodeid = require_int(self.env, "SLURM_NODEID", 0)
        for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
            nodes = env_int(self.env, name)
            if nodes is not None:
                return rank_in_range("SLURM_NODEID", nodeid, nodes, f"{name}={nodes}", SLURM_FIX)
        tasks = self.world_size()  # a node of the step runs at least one task
        return rank_in_range("SLURM_NODEID", nodeid, tasks, f"SLURM_NTASKS={tasks}", SLURM_FIX)

    def _tasks_here(self) -> tuple[int, str]:
        """The most tasks a node of this step runs, and the variable that says so: the
        step's task counts, ``SLURM_NTASKS_PER_NODE``, the job's counts, else ``SLURM_NTASKS``."""
        for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
            counts = tasks_per_node(self.env.get(name, ""))
            if counts:
                return max(counts), f"{name}={self.env[name]}"
        tasks = self.world_size()
        return tasks, f"SLURM_NTASKS={tasks}"

    def master_address(self) -> str | None:
        if self.env.get("MASTER_ADDR"):
            return self.env["MASTER_ADDR"]
        nodelist = self.env.get("SLURM_NODELIST") or self.env.get("SLURM_JOB_NODELIST")
        return first_slurm_host(nodelist) if nodelist else DEFAULT_MASTER_ADDR

    def master_port(self) -> int | None:
        port = env_master_port(self.env)
        if port is not None:
            return port
        job_id = self.env.get("SLURM_JOB_ID", "")
        digits = "".join(c for c in job_id if c.isdigit())
        # The seed's scheme: every task of a job derives the same port without talking.
        return 15000 + int(digits[-4:]) if digits else 12910

    def job_id(self) -> str | None:
        return self.env.get("SLURM_JOB_ID") or self.env.get("SLURM_JOBID") or None

    def restart_count(self) -> int:
        return require_int(self.env, "SLURM_RESTART_COUNT", 0)

    def requeue_dir(self) -> str | None:
        return self.env.get("SLURM_SUBMIT_DIR") or None

    def requeue(self) -> None:
        """``scontrol requeue $SLURM_JOB_ID`` (a batch job, submitted requeueable)."""
        job_id = self.job_id()
        if not job_id:
            raise RuntimeError("SLURM_JOB_ID is not set: no job to requeue")
        command = ["scontrol", "requeue", job_id]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise RuntimeError(f"`{' '.join(command)}` failed: {error}") from None
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip()
            raise RuntimeError(f"`{' '.join(command)}` exited {done.returncode}: {said}")
