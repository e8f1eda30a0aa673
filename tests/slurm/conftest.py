"""The SLURM tests: a private two-node cluster (tests/slurm/cluster.py) for the whole session.

They start real daemons (and, as root, install the Debian packages when missing), so they
run only when asked for: ``pytest tests/slurm`` (or ``nox -s slurm``), or with
``CARDCAGE_SLURM_TESTS=1``. A broader run (``pytest``, ``pytest tests``) skips them with
that reason. Without root, or without a way to install SLURM, they skip with the reason; under
CI (``CI`` set, as CI services do) they fail with it instead, since the slurm session exists to
run them. ``CARDCAGE_SLURM_KEEP=1`` keeps the cluster's folder (logs, state) after the session.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
ENABLE = "CARDCAGE_SLURM_TESTS"


def _load(name: str, path: Path) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


cluster_module = _load("cardcage_tests_slurm_cluster", HERE / "cluster.py")


def _asked_for(config: pytest.Config) -> bool:
    if os.environ.get(ENABLE, "") not in ("", "0"):
        return True
    for arg in config.args:
        path = Path(arg.split("::")[0])
        path = (Path(config.invocation_params.dir) / path).resolve()
        if path == HERE or HERE in path.parents:
            return True
    return False


def _under_ci() -> bool:
    """CI services set ``CI`` (``true``): there a cluster that cannot start is a failure."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slurm: needs the private SLURM cluster of tests/slurm (root, Linux)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _asked_for(config):
        return
    skip = pytest.mark.skip(
        reason=f"SLURM tests start daemons: run `pytest tests/slurm`, `nox -s slurm`, or set "
        f"{ENABLE}=1"
    )
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def slurm() -> Iterator[object]:
    """A running two-node cluster (nodes n1, n2; 4 CPUs each); stopped after the session."""
    unavailable: str | None = None
    try:
        cluster = cluster_module.start(tie_to_parent=True)
    except cluster_module.Unavailable as error:
        unavailable = str(error)
    if unavailable is not None:
        # The slurm session exists to run these: under CI a cluster that cannot start fails it.
        if _under_ci():
            pytest.fail(f"the SLURM cluster cannot start under CI: {unavailable}", pytrace=False)
        pytest.skip(unavailable)
    try:
        yield cluster
    finally:
        pids = dict(cluster.pids)
        cluster.stop()
        left = [name for name, pid in pids.items() if cluster_module._alive(pid)]
        assert not left, f"daemons still running after stop: {left}"
        if os.environ.get("CARDCAGE_SLURM_KEEP", "") in ("", "0"):
            shutil.rmtree(cluster.base, ignore_errors=True)


@pytest.fixture(scope="session")
def example() -> ModuleType:
    """examples/slurm/train.py as a module (its data, model and plain reference loop)."""
    return _load("cardcage_example_slurm_train", ROOT / "examples" / "slurm" / "train.py")
