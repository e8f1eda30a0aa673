"""Tests of cardcage-horovod. They pass with only cardcage-core and this plugin installed (with
or without horovod itself), and in a full install: every selection loads this plugin alone
(``ALONE``), and horovod's presence is simulated where it matters."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest

from cardcage import Availability, MisconfigurationError, sdk, select

ALONE = {"CARDCAGE_PLUGINS_AUTOLOAD": "0", "CARDCAGE_PLUGINS": "horovod"}
HOROVODRUN = {"HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1"}


def horovod_backend() -> type:
    cls: type = sdk.registry(ALONE).accelerators["horovod"].cls
    return cls


@pytest.fixture
def without_horovod(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hide horovod, whether or not it is installed."""
    real = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name.split(".")[0] == "horovod" else real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.fixture
def with_horovod(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend horovod is installed and usable."""
    monkeypatch.setattr(
        horovod_backend(), "availability", classmethod(lambda cls, ctx: Availability(True))
    )


@pytest.fixture(autouse=True)
def no_gpu(fake_cuda: Callable[[int], None]) -> None:
    fake_cuda(0)


def test_it_is_discovered_through_its_entry_point() -> None:
    found = sdk.registry({}).accelerators["horovod"]
    assert (found.plugin, found.distribution) == ("horovod", "cardcage-horovod")


def test_without_horovod_naming_it_says_how_to_install_it(without_horovod: None) -> None:
    with pytest.raises(MisconfigurationError) as error:
        select(env=ALONE, distributed_backend="horovod")
    assert "horovod is not installed" in str(error.value)
    # A command a pip user has: the builder ships inside cardcage-horovod.
    assert "python -m cardcage_horovod.build --install" in str(error.value)
    assert "C++17 patch" in str(error.value)


def test_without_horovod_horovodrun_processes_are_not_claimed(without_horovod: None) -> None:
    # The rule claims, the backend is unavailable, and nothing else is loaded.
    with pytest.raises(MisconfigurationError, match="no installed backend claims this job"):
        select(env={**ALONE, **HOROVODRUN})


def test_it_claims_processes_started_by_horovodrun(with_horovod: None) -> None:
    selection = select(env={**ALONE, **HOROVODRUN})
    assert (selection.accelerator, selection.rule, selection.cluster) == (
        "horovod",
        "horovodrun",
        "horovod",
    )
    assert (selection.world_size, selection.global_rank, selection.local_rank) == (4, 3, 1)
    assert selection.num_processes == 4  # per node, from the launcher


def test_it_claims_processes_started_by_mpirun(with_horovod: None) -> None:
    mpirun = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}
    assert select(env={**ALONE, **mpirun}).accelerator == "horovod"


@pytest.mark.parametrize(
    ("flags", "flag"), [({"gpus": 2}, "gpus=2"), ({"num_nodes": 2}, "num_nodes=2")]
)
def test_it_refuses_process_counts_from_flags(
    with_horovod: None, fake_cuda: Callable[[int], None], flags: dict[str, int], flag: str
) -> None:
    fake_cuda(2)
    with pytest.raises(MisconfigurationError, match=rf"with {flag}: .*horovodrun -np"):
        select(env=ALONE, distributed_backend="horovod", **flags)


@pytest.mark.slow  # starts a fresh interpreter
def test_discovery_and_selection_never_import_horovod() -> None:
    script = textwrap.dedent(
        """
        import sys
        from cardcage import MisconfigurationError, sdk, select
        assert "horovod" in sdk.registry({}).accelerators
        try:
            select(env={"CARDCAGE_PLUGINS_AUTOLOAD": "0", "CARDCAGE_PLUGINS": "horovod"})
        except MisconfigurationError:
            pass  # alone, nothing claims a plain job
        print(sorted(m for m in sys.modules if m.split(".")[0] == "horovod"))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
