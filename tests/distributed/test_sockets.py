"""A single-node job lets no one in: every socket it listens on is bound to loopback; and
whatever loopback address ``MASTER_ADDR`` names, its ranks meet there and train."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import time
from pathlib import Path

import pytest

from cardcage.backend.launch import rendezvous

from .conftest import PYTHON, SCRIPTS, Harness

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net")


def _tree(root: int) -> set[int]:
    """``root`` and every process descended from it."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rpartition(")")[2].split()[1])
    tree, grew = {root}, True
    while grew:
        found = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= found
        grew = bool(found)
    return tree


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])  # /proc/net/tcp: host byte order
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return ipaddress.IPv6Address(words)


def listening(pids: set[int]) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket that ``pids`` listen on."""
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                host, port = fields[1].split(":")
                found.append((str(_address(host)), int(port, 16)))
    return found


@pytest.mark.parametrize("backend", ["ddp_spawn", "ddp"])
def test_a_single_node_job_listens_on_loopback_only(backend: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.pop("GLOO_SOCKET_IFNAME", None)
    job = subprocess.Popen(
        [PYTHON, str(SCRIPTS / "pause_job.py"), str(tmp_path), backend],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"paused-{r}").exists() for r in (0, 1)):
            assert job.poll() is None, job.communicate()[0]
            assert time.monotonic() < deadline, "the job never reached its third step"
            time.sleep(0.1)
        sockets = listening(_tree(job.pid))
    finally:
        (tmp_path / "go").touch()
        output = job.communicate(timeout=120)[0]
    assert job.returncode == 0, output
    # The rendezvous store and gloo's listeners, at least: the test sees the job's sockets.
    assert len(sockets) >= 2, sockets
    exposed = [s for s in sockets if not ipaddress.ip_address(s[0]).is_loopback]
    assert not exposed, f"{backend} listens beyond loopback: {exposed} (all: {sockets})"


#: Seconds the ranks may take to meet: a job whose store is not where its ranks dial fails
#: after this (it hung for the whole default of 300 s), well inside the run's deadline.
JOIN_S = "30"


@pytest.mark.parametrize(
    ("backend", "address"),
    [
        ("ddp_spawn", "::1"),
        ("ddp", "::1"),
        ("ddp_spawn", "127.0.0.2"),
        ("ddp", "127.0.0.2"),
        ("ddp_spawn", "::"),
    ],
)
def test_a_loopback_master_addr_without_a_port_trains(
    harness: Harness, tmp_path: Path, backend: str, address: str
) -> None:
    # The store the launcher hosts listened on 127.0.0.1 while the ranks dialled MASTER_ADDR:
    # "rank 0 never arrived" after CARDCAGE_INIT_TIMEOUT. It listens where they dial now (a
    # wildcard such as :: meets on the loopback address of its family), and the job trains to
    # the weights of one process at the double batch.
    if ":" in address:
        unusable = rendezvous.bind_error("::1")
        if unusable is not None:
            pytest.skip(f"IPv6 loopback is not usable here: binding ::1 fails ({unusable})")
    out = tmp_path / "out"
    out.mkdir()
    env = harness.env(MASTER_ADDR=address, CARDCAGE_INIT_TIMEOUT=JOIN_S)
    harness.python_job(
        out, "--backend", backend, "--num-processes", "2", "--batch-size", "8", env=env
    ).check()
    results = harness.results(out)
    assert results, "no rank reported a result"
    reference = harness.reference(16)
    for result in results.values():
        assert result["accelerator"] == backend
        assert result["weights"] == pytest.approx(reference, abs=1e-5)
    harness.assert_no_leftovers()
