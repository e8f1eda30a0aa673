"""Tests of cardcage-tpu. They pass with only cardcage-core and this plugin installed (with or
without torch-xla), and in a full install: every selection loads this plugin alone
(``ALONE``), and torch-xla's presence is simulated where it matters."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
import textwrap

import pytest

from cardcage import Availability, MisconfigurationError, sdk, select

ALONE = {"CARDCAGE_PLUGINS_AUTOLOAD": "0", "CARDCAGE_PLUGINS": "tpu"}


def tpu_backend() -> type:
    cls: type = sdk.registry(ALONE).accelerators["tpu"].cls
    return cls


def fake_torch_xla(monkeypatch: pytest.MonkeyPatch, version: str | None) -> None:
    """Pretend torch-xla ``version`` is installed, or (``None``) that it is not."""
    real_find_spec, real_version = importlib.util.find_spec, importlib.metadata.version

    def find_spec(name: str, *args: object) -> object:
        if name.split(".")[0] == "torch_xla":
            return None if version is None else object()
        return real_find_spec(name, *args)  # type: ignore[arg-type]

    def dist_version(name: str) -> str:
        return version if name == "torch-xla" and version else real_version(name)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(importlib.metadata, "version", dist_version)


@pytest.fixture
def with_xla(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend torch-xla is installed and a TPU is attached."""
    monkeypatch.setattr(
        tpu_backend(), "availability", classmethod(lambda cls, ctx: Availability(True))
    )


def test_it_is_discovered_through_its_entry_point() -> None:
    found = sdk.registry({}).accelerators["tpu"]
    assert (found.plugin, found.distribution) == ("tpu", "cardcage-tpu")


def test_it_claims_a_job_with_tpu_cores(with_xla: None) -> None:
    selection = select(env=ALONE, tpu_cores=8)
    assert (selection.accelerator, selection.rule, selection.num_processes) == (
        "tpu",
        "tpu_cores",
        8,
    )


def test_one_named_core_trains_in_this_process(with_xla: None) -> None:
    selection = select(env=ALONE, tpu_cores="5,")
    assert (selection.tpu_cores, selection.num_processes) == ([5], 1)


def test_without_torch_xla_naming_it_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_torch_xla(monkeypatch, None)
    with pytest.raises(MisconfigurationError) as error:
        select(env=ALONE, distributed_backend="tpu", tpu_cores=8)
    assert "torch_xla is not installed" in str(error.value)
    assert "pip install torch==2.9.0 torch-xla==2.9.0" in str(error.value)


def test_a_torch_xla_for_another_torch_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_torch_xla(monkeypatch, "1.13.0")
    with pytest.raises(MisconfigurationError, match=r"torch-xla 1.13.0 needs torch 1.13.\*"):
        select(env=ALONE, distributed_backend="tpu", tpu_cores=1)


def test_naming_it_without_tpu_cores_is_an_error() -> None:
    with pytest.raises(MisconfigurationError, match=r"'tpu' needs tpu_cores.*tpu_cores=1"):
        select(env=ALONE, distributed_backend="tpu")


def test_it_refuses_several_nodes(with_xla: None) -> None:
    with pytest.raises(MisconfigurationError, match=r"'tpu' runs on one node, but num_nodes=2"):
        select(env=ALONE, distributed_backend="tpu", tpu_cores=8, num_nodes=2)


@pytest.mark.slow  # starts a fresh interpreter
def test_discovery_and_selection_never_import_torch_xla() -> None:
    script = textwrap.dedent(
        """
        import sys
        from cardcage import MisconfigurationError, sdk, select
        assert "tpu" in sdk.registry({}).accelerators
        try:
            select(env={"CARDCAGE_PLUGINS_AUTOLOAD": "0", "CARDCAGE_PLUGINS": "tpu"})
        except MisconfigurationError:
            pass  # alone, nothing claims a job without tpu_cores
        print(sorted(m for m in sys.modules if m.split(".")[0] == "torch_xla"))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
