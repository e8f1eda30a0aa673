"""The conformance kit's purity check catches a backend that starts something while
selecting, even when it is over again before selection returns."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import plugin_install
import pytest
from plugin_install import describe, pip_install, plugin_source

pytestmark = pytest.mark.slow

# Its availability asks a helper process and a thread, and waits for both: nothing is left.
LEAKY = """
import subprocess, sys, threading
import cardcage


class Leaky(cardcage.Accelerator):
    name = "leaky"

    @classmethod
    def availability(cls, ctx):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        thread = threading.Thread(target=lambda: None)
        thread.start()
        thread.join()
        return cardcage.Availability(True)


@cardcage.hookimpl
def cardcage_accelerators():
    return [Leaky]
"""

SUITE = """
from cardcage.testing import BackendSuite


class TestLeaky(BackendSuite):
    backend = "leaky"
"""


def test_a_backend_that_starts_and_ends_a_process_while_selecting_fails(tmp_path: Path) -> None:
    """Counting what is open after select misses a process or thread that already ended;
    the kit watches what is started."""
    site = tmp_path / "site"
    source = plugin_source(tmp_path / "src", "leaky", LEAKY)
    pip_install(site, [source], "the leaky plugin")
    (tmp_path / "test_leaky.py").write_text(SUITE)
    env = plugin_install.child_env(
        [site], plugin_install.STEERING_PREFIXES, plugin_install.STEERING_NAMES
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "pure"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 1, describe(result)
    assert "AssertionError: select started a process: " in result.stdout, describe(result)
    assert "'-c', 'pass'" in result.stdout, describe(result)
