"""Which processes a test's code starts: a scan of /proc for this process's children.

Shared by the tests that show a bad input is refused before any process starts (imported as
``processes``: see conftest.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path


def children() -> set[int]:
    """The live processes whose parent is this one (a /proc scan)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path("/proc", entry, "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
        if fields.get("PPid", "").strip() == str(os.getpid()) and not fields.get(
            "State", ""
        ).startswith(("Z", "X")):
            found.add(int(entry))
    return found


@contextlib.contextmanager
def watching_children() -> Iterator[set[int]]:
    """Every child process of this one that appears while the block runs (polled)."""
    before = children()
    seen: set[int] = set()
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            seen.update(children() - before)
            done.wait(0.002)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        done.set()
        thread.join()
        seen.update(children() - before)
