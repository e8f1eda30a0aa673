"""The Ray backends' job, run by the tests as a user runs a script:
``python ray_job.py OUT BACKEND MODE [KEY=VALUE...]``; it writes ``OUT/result.json``.

MODE: ``plain`` (2 ranks of batch 8, and a plain loop of batch 16 in this process, to
compare), ``straight`` and ``once`` (2 epochs of Adam with dropout, a step checkpoint every
2 steps, ``max_restarts=1``; under ``once`` rank 1 SIGKILLs its own actor at global step 7 of
8, on the first attempt only), ``always`` (it does so at every attempt), ``raise`` (rank 1
raises in its third step), ``stuck`` (rank 1 sleeps in its third step), ``sockets`` (rank 0
writes ``sockets.json``: ``MASTER_ADDR``, ``MASTER_PORT`` and the addresses it listens on at
that port) and ``cage`` (an own loop that reports where each rank ran). Options: ``nodes=N``
(``num_nodes``, 2), ``procs=N`` (``num_processes``, 1).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def dataset() -> TensorDataset:
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(3))
    return TensorDataset(x, x[:, :1] * x[:, 1:2])


class Net(cardcage.Module):
    def __init__(self, out: str, mode: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        dropout = 0.2 if mode in ("straight", "once", "always") else 0.0
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 16),
            torch.nn.Tanh(),
            torch.nn.Dropout(dropout),
            torch.nn.Linear(16, 1),
        )
        self.register_buffer("step", torch.zeros((), dtype=torch.long))  # resumes with it
        self.out, self.mode = out, mode
        self.started = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.step += 1
        step, mode = int(self.step), self.mode
        if not self.started and rank() == 0:
            # The step each attempt starts at: a restart from scratch would train to the
            # same weights, so this is what shows that it resumed from a checkpoint.
            with Path(self.out, "starts").open("a") as starts:
                starts.write(f"{step}\n")
        self.started = True
        if rank() == 1 and step == 7 and mode in ("once", "always"):
            marker = Path(self.out, "killed")
            if mode == "always" or not marker.exists():
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
        if rank() == 0 and step == 1 and mode == "sockets":
            # Where this rank (it hosts the process group's store) listens on MASTER_PORT.
            port = int(os.environ["MASTER_PORT"])
            found = {"master_addr": os.environ["MASTER_ADDR"], "port": port}
            found["store"] = [host for host, p in listening(os.getpid()) if p == port]
            Path(self.out, "sockets.json").write_text(json.dumps(found))
        if rank() == 1 and step == 3 and mode == "raise":
            raise RuntimeError("rank 1 gives up")
        if rank() == 1 and step == 3 and mode == "stuck":
            time.sleep(600)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        if self.mode == "plain":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return torch.optim.Adam(self.parameters(), lr=0.01)


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))  # /proc/net/tcp: host byte order
    return str(ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))))


def listening(pid: int) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket process ``pid`` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                host, port = fields[1].split(":")
                found.append((_address(host), int(port, 16)))
    return found


def weights(model: torch.nn.Module) -> list[float]:
    return [float(v) for p in model.parameters() for v in p.detach().reshape(-1)]


def plain_loop(out: str) -> list[float]:
    """One process, batch 16: what two ranks of batch 8 must reproduce."""
    model = Net(out, "plain")
    optimizer = model.configure_optimizers()
    for x, y in DataLoader(dataset(), batch_size=16):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model.net(x), y).backward()
        optimizer.step()
    return weights(model)


def where(cage: cardcage.Cage, out: str) -> dict[str, Any]:
    """A Cage's job: each rank writes the Ray node it ran on; rank 0's return comes back."""
    import ray

    Path(out, f"node-{cage.global_rank}").write_text(ray.get_runtime_context().get_node_id())
    return {"rank": cage.global_rank, "world": cage.world_size}


def children() -> list[str]:
    """The command lines of this process's live children (not zombies)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                found.append(stat.with_name("cmdline").read_text().replace("\0", " ").strip())
        except (OSError, IndexError, ValueError):
            continue
    return found


def main() -> None:
    out, backend, mode = sys.argv[1:4]
    options = dict(arg.split("=", 1) for arg in sys.argv[4:])
    flags = {
        "distributed_backend": backend,
        "num_nodes": int(options.get("nodes", 2)),
        "num_processes": int(options.get("procs", 1)),
    }
    result: dict[str, Any] = {}
    if mode == "cage":
        result["returned"] = cardcage.Cage(**flags).launch(where, out)
    else:
        restarts = 1 if mode in ("straight", "once", "always") else 0
        trainer = cardcage.Trainer(
            **flags,
            max_epochs=2 if restarts else 1,
            checkpoint_every_n_steps=2 if restarts else None,
            max_restarts=restarts,
            progress_bar=False,
            logger=False,
        )
        model = Net(out, mode)
        batch = 8 if mode == "plain" else 4
        trainer.fit(model, DataLoader(dataset(), batch_size=batch, shuffle=mode != "plain"))
        result = {"weights": weights(model), "restarts": trainer.restarts}
        result["children"] = children()  # a Ray this job started is gone when fit returns
        if mode == "plain":
            result["plain"] = plain_loop(out)
    Path(out, "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
