"""Discovery and default selection never import a backend's engine (horovod, torch_xla).

Fake top-level packages ``horovod`` and ``torch_xla``, each with a ``*.dist-info`` so that
``importlib.metadata`` sees them as installed, are put on ``PYTHONPATH``. Importing either
writes a marker file holding the stack that imported it. Loading every plugin and selecting
with default flags must leave no marker; asking the tpu or horovod backend whether it can run
(``tpu_cores`` set, or ``distributed_backend='horovod'``) may, and with these fakes does, so the
markers are known to work.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

STEERING_PREFIXES = ("CARDCAGE_", "PL_TRAINER_", "SLURM_", "TORCHELASTIC_", "OMPI_", "PMI_")
STEERING_PREFIXES += ("PMIX_", "HOROVOD_")
STEERING_NAMES = ("WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK")
STEERING_NAMES += ("MASTER_ADDR", "MASTER_PORT", "PJRT_DEVICE", "PYTHONPATH", "XRT_TPU_CONFIG")

MARKER = """
import os, traceback
_dir = os.environ.get("FAKE_ENGINE_MARKERS")
if _dir:
    with open(os.path.join(_dir, __name__), "a") as _file:
        _file.write("".join(traceback.format_stack()) + "\\n")
"""

FAKES = {
    "horovod/__init__.py": MARKER + '__version__ = "0.28.1"\n',
    "horovod/torch/__init__.py": MARKER
    + textwrap.dedent(
        """
        def gloo_built():
            return True

        def mpi_built():
            return False
        """
    ),
    "torch_xla/__init__.py": MARKER,
    "torch_xla/runtime.py": MARKER
    + textwrap.dedent(
        """
        def device_type():
            return os.environ.get("PJRT_DEVICE")
        """
    ),
}

PROBE = textwrap.dedent(
    """\
    import json, os, sys
    import cardcage
    from cardcage.plugins import manager as plugins

    selection = cardcage.select(**json.loads(sys.argv[1]))
    registry = plugins.registry(os.environ)
    engines = sorted(m for m in sys.modules if m.split(".")[0] in ("horovod", "torch_xla"))
    print(json.dumps({
        "accelerator": selection.accelerator,
        "backends": sorted(registry.accelerators),
        "plugins": {r.name: r.status for r in registry.plugins},
        "engines": engines,
    }))
    """
)


def _dist_info(root: Path, name: str, version: str) -> None:
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "top_level.txt").write_text(name.replace("-", "_") + "\n")


@pytest.fixture(scope="module")
def fakes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fake_engines")
    for relative, source in FAKES.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    # torch-xla must match torch's release for the tpu plugin to go as far as importing it
    torch_release = importlib.metadata.version("torch").split("+")[0]
    _dist_info(root, "torch-xla", torch_release)
    _dist_info(root, "horovod", "0.28.1")
    return root


@pytest.fixture
def markers(tmp_path: Path) -> Path:
    folder = tmp_path / "markers"
    folder.mkdir()
    return folder


def child_env(fakes: Path, markers: Path, **extra: str) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(STEERING_PREFIXES) and key not in STEERING_NAMES
    }
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = str(fakes)
    env["FAKE_ENGINE_MARKERS"] = str(markers)
    env.update(extra)
    return env


def run(
    args: Sequence[str], env: dict[str, str], statuses: Sequence[int] = (0,)
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, *args],
        env=env,
        cwd=Path(env["PYTHONPATH"]).parent,  # a neutral directory: -m and -c put it on sys.path
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode in statuses, (
        f"$ {' '.join(args)}\nexit {result.returncode}\n{result.stdout}\n{result.stderr}"
    )
    return result


def imported(markers: Path) -> dict[str, str]:
    """Engine module name → the stack that imported it."""
    return {path.name: path.read_text() for path in sorted(markers.iterdir())}


def test_the_fakes_write_markers(fakes: Path, markers: Path) -> None:
    run(["-c", "import torch_xla.runtime, horovod.torch"], child_env(fakes, markers))
    assert set(imported(markers)) == {"torch_xla", "torch_xla.runtime", "horovod", "horovod.torch"}
    assert importlib.util.find_spec("torch_xla") is None, "the fakes must not leak into this venv"


@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"tpu_cores": None},
        {"tpu_cores": None, "gpus": None, "num_processes": 2},
        {"distributed_backend": "ddp_cpu", "num_processes": 2},
        {"distributed_backend": "cpu"},
        {"distributed_backend": "ddp"},
    ],
    ids=repr,
)
def test_discovery_and_select_import_no_engine(
    fakes: Path, markers: Path, flags: dict[str, Any]
) -> None:
    result = run(["-c", PROBE, json.dumps(flags)], child_env(fakes, markers))
    report = json.loads(result.stdout)
    # the tpu and horovod plugins were found and loaded ...
    assert {"tpu", "horovod"} <= set(report["backends"])
    assert report["plugins"]["tpu"] == report["plugins"]["horovod"] == "loaded"
    # ... without importing what they drive
    assert report["engines"] == []
    assert imported(markers) == {}


@pytest.mark.parametrize("extra", [{}, {"PJRT_DEVICE": "CPU"}], ids=["plain", "PJRT_DEVICE"])
def test_default_explain_imports_no_engine(
    fakes: Path, markers: Path, extra: dict[str, str]
) -> None:
    result = run(["-m", "cardcage", "explain", "--json"], child_env(fakes, markers, **extra))
    selection = json.loads(result.stdout)
    assert selection["accelerator"] == "cpu"
    outcomes = {e["accelerator"]: e["outcome"] for e in selection["trace"]}
    assert outcomes["tpu"] == outcomes["horovod"] == "not claimed"
    assert imported(markers) == {}


# The two checks below only need the availability check to go as far as importing the engine;
# whether these fakes then pass for a working torch-xla or Horovod is up to the plugins (which
# may look deeper into the engine's internals than the fakes provide).


def test_tpu_availability_imports_torch_xla_when_asked(fakes: Path, markers: Path) -> None:
    env = child_env(fakes, markers, PJRT_DEVICE="CPU")
    result = run(["-m", "cardcage", "explain", "--tpu-cores", "1", "--json"], env, statuses=(0, 2))
    if result.returncode == 0:
        assert json.loads(result.stdout)["accelerator"] == "tpu"
    else:  # the rule claimed, and the fake torch_xla was judged unusable: that is the error
        assert "tpu_cores=1" in result.stderr and "torch_xla" in result.stderr
    assert "torch_xla" in imported(markers)
    assert "horovod" not in imported(markers)


def test_horovod_availability_imports_horovod_when_asked(fakes: Path, markers: Path) -> None:
    env = child_env(fakes, markers)
    args = ["-m", "cardcage", "explain", "--backend", "horovod", "--json"]
    result = run(args, env, statuses=(0, 2))
    if result.returncode == 0:
        assert json.loads(result.stdout)["accelerator"] == "horovod"
    else:  # named but judged unavailable: the reason comes from looking at horovod
        assert "'horovod'" in result.stderr and "not available" in result.stderr
    assert "horovod" in imported(markers)
    assert "torch_xla" not in imported(markers)
