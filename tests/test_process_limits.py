"""More processes than this machine can run are refused by ``fit``, in the calling process,
before any is started, with the limit that says so.

A ``ddp_spawn`` fit of ``num_processes=10000`` was accepted: under a pids limit the 57th
start failed with ``BlockingIOError``. Each process cardcage starts takes at least
``flags.TASKS_PER_PROCESS`` tasks and ``flags.MEMORY_PER_PROCESS`` bytes; fit compares that
with what the kernel, the cgroup, ``RLIMIT_NPROC`` and the free memory allow.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from processes import watching_children

import cardcage
from cardcage.config import flags


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.layer(batch[0]).pow(2).mean()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=2
    )


def holds(count: int) -> bool:
    """Whether this machine could hold ``count`` processes by the rule fit applies."""
    tasks, memory = flags.free_tasks(), flags.free_memory()
    return (tasks is None or count * flags.TASKS_PER_PROCESS <= tasks[0]) and (
        memory is None or count * flags.MEMORY_PER_PROCESS <= memory[0]
    )


def test_ten_thousand_processes_are_refused_before_any_starts() -> None:
    if holds(10000):  # a machine this large would start them: nothing to refuse
        pytest.skip("this machine can hold 10000 processes by the rule")
    trainer = cardcage.Trainer(
        distributed_backend="ddp_spawn", num_processes=10000, progress_bar=False
    )
    with watching_children() as started, pytest.raises(cardcage.MisconfigurationError) as raised:
        trainer.fit(Tiny(), loader())
    message = str(raised.value)
    assert "num_processes=10000 is more processes than this machine can run" in message
    assert "Use at most" in message
    assert "kernel.pid_max" in message or "MemAvailable" in message or "pids.max" in message
    assert started == set(), f"processes started: {started}"


CHILD = textwrap.dedent(
    """
    import os
    import resource
    import sys

    import torch

    import cardcage
    from cardcage.config import flags

    sys.path.insert(0, sys.argv[1])
    from test_process_limits import Tiny, loader

    trainer = cardcage.Trainer(distributed_backend="ddp_spawn", num_processes=3)
    data = loader()
    if os.getuid() == 0:  # RLIMIT_NPROC does not bind root: train as nobody
        os.setgid(65534)
        os.setuid(65534)
    mine = flags._user_tasks(os.getuid())
    resource.setrlimit(resource.RLIMIT_NPROC, (mine + 8, mine + 8))
    try:
        trainer.fit(Tiny(), data)
    except cardcage.MisconfigurationError as error:
        print("REFUSED", error)
    """
)


def test_a_process_limit_is_named_with_what_it_allows() -> None:
    # Three workers need at least 12 tasks; RLIMIT_NPROC lets 8 more start.
    done = subprocess.run(
        [sys.executable, "-c", CHILD, os.path.dirname(__file__)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "REFUSED" in done.stdout, done.stdout + done.stderr
    message = done.stdout.partition("REFUSED ")[2]
    assert "num_processes=3 is more processes than this machine can run" in message
    assert re.search(r"only \d more may start \(RLIMIT_NPROC=\d+ \(ulimit -u\)", message), message
    assert re.search(r"Use at most [0-2] processes", message), message
