"""cardcage.backend.strategy.group_exit: at exit, a process waits for the process group's
threads to settle."""

from __future__ import annotations

import hashlib
import sys
import threading
import time

import pytest

from cardcage.backend.strategy import group_exit

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _thread(target: object) -> int:
    started = group_exit.threads()
    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    time.sleep(0.05)
    (tid,) = group_exit.threads() - started
    return tid


def test_a_sleeping_thread_is_settled_at_once() -> None:
    stop = threading.Event()
    tid = _thread(stop.wait)
    began = time.monotonic()
    assert group_exit.settle({tid}, timeout=1.0)
    assert time.monotonic() - began < 0.5
    stop.set()


def test_a_busy_thread_is_waited_for_until_the_timeout() -> None:
    stop = threading.Event()

    data = b"x" * 10_000_000

    def spin() -> None:
        while not stop.is_set():
            hashlib.sha256(data)  # hashes without the GIL: runnable off it, like gloo's

    tid = _thread(spin)
    try:
        began = time.monotonic()
        assert not group_exit.settle({tid}, timeout=0.3)
        assert time.monotonic() - began >= 0.3
    finally:
        stop.set()
    assert group_exit.settle({tid}, timeout=2.0)  # done spinning: settled
