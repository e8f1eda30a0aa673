"""cardcage installed from its wheels (dist/) into clean virtual environments, the way a pip
user has it: no repository, nothing editable.

Two environments (see conftest.py): ``pip install cardcage`` (the meta-distribution), and
``pip install cardcage-core cardcage-spawn`` (the core and one plugin). In them: the
distributions come from dist/ and the repository is on no ``sys.path``; ``cardcage plugins``,
``cardcage explain`` and ``cardcage demo`` work; a 2-process ddp_spawn fit matches a plain
loop; ``cardcage new-plugin`` writes a plugin that installs and passes its own tests, the
conformance kit's included.

Each environment is a new virtual environment (no system site-packages) that gets torch (the
pin of requirements-dev.txt, a CPU wheel on disk) and the third-party requirements the wheels
declare from the usual package sources, and then the cardcage distributions with
``pip install --no-index --find-links dist/``: from dist/ alone, none editable. Every command
runs from a folder outside the repository. ``nox -s wheels`` builds dist/ (``nox -s build``)
and runs these; conftest.py skips them in broader runs. ``CARDCAGE_DIST`` names another
folder of wheels.
"""

from __future__ import annotations

import email.parser
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DIST = Path(os.environ.get("CARDCAGE_DIST") or ROOT / "dist")
# What must not leak from the test process into the environments' commands.
STEERING_PREFIXES = ("CARDCAGE_", "PL_TRAINER_", "SLURM_", "TORCHELASTIC_", "OMPI_", "PMI_")
STEERING_PREFIXES += ("PMIX_", "HOROVOD_", "PYTHON", "VIRTUAL_ENV", "PJRT_")
STEERING_NAMES = ("WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "LOCAL_WORLD_SIZE")
STEERING_NAMES += ("MASTER_ADDR", "MASTER_PORT")


def torch_pin() -> str:
    """The torch requirement of requirements-dev.txt (the CPU build that lies on disk)."""
    for line in (ROOT / "requirements-dev.txt").read_text().splitlines():
        spec = line.strip()
        if spec and not spec.startswith(("#", "-")) and Requirement(spec).name == "torch":
            return spec
    raise RuntimeError("requirements-dev.txt pins no torch")


# -- the wheels -------------------------------------------------------------------------------


def wheels() -> dict[str, Path]:
    """The wheels of dist/ by distribution name; a failure when there are none."""
    found = {str(canonicalize_name(path.name.split("-")[0])): path for path in DIST.glob("*.whl")}
    if not found:
        pytest.fail(f"no wheels in {DIST}: `nox -s build` makes them (`nox -s wheels` does both)")
    return found


def _requires(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = email.parser.Parser().parsestr(archive.read(name).decode())
    return [Requirement(line) for line in metadata.get_all("Requires-Dist") or []]


def closure(names: Iterable[str]) -> tuple[set[str], list[str]]:
    """The cardcage distributions that installing ``names`` brings (from dist/), and the
    third-party requirements they declare (extras left out)."""
    available = wheels()
    ours: set[str] = set()
    theirs: list[str] = []
    todo = [str(canonicalize_name(n)) for n in names]
    while todo:
        name = todo.pop()
        if name in ours:
            continue
        ours.add(name)
        for requirement in _requires(available[name]):
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            other = str(canonicalize_name(requirement.name))
            if other in available:
                todo.append(other)
            else:
                requirement.marker = None
                theirs.append(str(requirement))
    return ours, sorted(set(theirs))


# -- the environments -------------------------------------------------------------------------


@dataclass
class Environment:
    """A virtual environment with cardcage from dist/, and a folder outside the repository
    where its commands run."""

    prefix: Path
    work: Path
    installed: set[str]  # the cardcage distributions it got

    def env(self, **extra: str) -> dict[str, str]:
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(STEERING_PREFIXES) and key not in STEERING_NAMES
        }
        env["PATH"] = os.pathsep.join([str(self.prefix / "bin"), env.get("PATH", "")])
        env["VIRTUAL_ENV"] = str(self.prefix)
        env["CUDA_VISIBLE_DEVICES"] = ""  # a GPU host behaves like a CPU one
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra)
        return env

    def run(
        self,
        command: Sequence[str],
        cwd: Path | None = None,
        timeout: float = 600,
        check: bool = True,
        **extra: str,
    ) -> subprocess.CompletedProcess[str]:
        """``command`` with this environment's bin/ first on ``PATH``, in ``cwd`` (default:
        the work folder); it must exit 0 unless ``check`` is false."""
        program, *args = command
        if (self.prefix / "bin" / program).exists():
            program = str(self.prefix / "bin" / program)
        result = subprocess.run(
            [program, *args],
            cwd=cwd or self.work,
            env=self.env(**extra),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check:
            assert result.returncode == 0, describe(result)
        return result

    def cardcage_json(self, *args: str, **extra: str) -> Any:
        return json.loads(self.run(["cardcage", *args, "--json"], **extra).stdout)


def describe(result: subprocess.CompletedProcess[str]) -> str:
    return (
        f"$ {' '.join(map(str, result.args))}\nexit {result.returncode}\n"
        f"--- stdout\n{result.stdout[-6000:]}\n--- stderr\n{result.stderr[-6000:]}"
    )


def make_environment(base: Path, *names: str) -> Environment:
    """A new virtual environment at ``base/venv`` with ``names`` installed from dist/."""
    assert ROOT not in base.resolve().parents, f"{base} is inside the repository"
    prefix, work = base / "venv", base / "work"
    work.mkdir(parents=True)
    made = subprocess.run(
        [sys.executable, "-m", "venv", str(prefix)], capture_output=True, text=True, check=False
    )
    assert made.returncode == 0, describe(made)
    environment = Environment(prefix, work, set())
    ours, theirs = closure(names)
    pip = ["python", "-m", "pip", "--disable-pip-version-check"]
    # torch and the other third-party requirements, from wherever pip finds them (the torch
    # pin lies on disk); bytecode is left to the first import, which is faster here.
    environment.run([*pip, "install", "--no-compile", torch_pin(), *theirs], timeout=900)
    # cardcage from dist/ alone: --no-index, so no distribution of ours can come from elsewhere.
    environment.run([*pip, "install", "--no-index", "--find-links", str(DIST), *names])
    environment.run([*pip, "check"])
    environment.installed = ours
    return environment


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Environment:
    """``pip install cardcage``: the meta-distribution, the core and its seven backends."""
    return make_environment(tmp_path_factory.mktemp("wheels-cardcage"), "cardcage")


@pytest.fixture(scope="module")
def alone(tmp_path_factory: pytest.TempPathFactory) -> Environment:
    """``pip install cardcage-core cardcage-spawn``: the core and one plugin."""
    return make_environment(
        tmp_path_factory.mktemp("wheels-core-spawn"), "cardcage-core", "cardcage-spawn"
    )


# -- the tests -------------------------------------------------------------------------------

TOLERANCE = 1e-5
# Backends of `pip install cardcage` (pyproject.toml's dependencies; fsdp adds fsdp_spawn).
META_BACKENDS = {"cpu", "gpu", "dp", "ddp", "ddp2", "ddp_spawn", "fsdp"}

PROBE = textwrap.dedent(
    """
    import importlib.metadata, json, site, sys
    import cardcage
    found = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name.lower().startswith("cardcage"):
            direct = dist.read_text("direct_url.json")
            found[name.lower()] = {"version": dist.version, "direct_url": direct}
    pth = {}
    for folder in site.getsitepackages():
        import pathlib
        for path in pathlib.Path(folder).glob("*.pth"):
            pth[path.name] = path.read_text()
    print(json.dumps({"dists": found, "cardcage": cardcage.__file__, "version":
        cardcage.__version__, "path": sys.path, "prefix": sys.prefix, "pth": pth}))
    """
)


def probe(environment: Environment) -> dict[str, object]:
    result = environment.run(["python", "-c", PROBE])
    found: dict[str, object] = json.loads(result.stdout)
    return found


@pytest.mark.parametrize("which", ["full", "alone"])
def test_the_distributions_come_from_dist_and_the_repository_is_off_sys_path(
    which: str, request: pytest.FixtureRequest
) -> None:
    environment: Environment = request.getfixturevalue(which)
    found = probe(environment)
    dists = found["dists"]
    assert isinstance(dists, dict)
    assert set(dists) == environment.installed
    for name, info in dists.items():
        # Installed by name from --find-links: no direct URL, so nothing editable either.
        assert info["direct_url"] is None, (name, info)
        assert info["version"] == found["version"], (name, info)
    prefix = str(found["prefix"])
    assert str(found["cardcage"]).startswith(prefix + "/lib/"), found["cardcage"]
    for entry in found["path"]:  # type: ignore[attr-defined]
        assert not (entry == str(ROOT) or entry.startswith(f"{ROOT}/")), entry
    for name, text in found["pth"].items():  # type: ignore[attr-defined]
        assert str(ROOT) not in text, (name, text)
    config = (environment.prefix / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = false" in config


def test_cardcage_plugins_lists_what_was_installed(full: Environment, alone: Environment) -> None:
    strict = {"CARDCAGE_STRICT_PLUGINS": "1"}  # a plugin that fails to load is an error
    listing = full.cardcage_json("plugins", **strict)
    backends = {row["name"]: row for row in listing["backends"]}
    assert set(backends) >= META_BACKENDS
    # Every backend comes from an installed plugin, and every installed plugin gives one.
    assert {row["distribution"] for row in backends.values()} == full.installed - {
        "cardcage",
        "cardcage-core",
    }
    assert backends["cpu"]["available"] is True and backends["ddp_spawn"]["available"] is True
    assert backends["fsdp"]["distribution"] == "cardcage-fsdp"

    listing = alone.cardcage_json("plugins", **strict)
    assert [row["name"] for row in listing["backends"]] == ["ddp_spawn"]


def test_cardcage_explain_decides_without_training(full: Environment, alone: Environment) -> None:
    decision = full.cardcage_json("explain")
    assert (decision["accelerator"], decision["rule"]) == ("cpu", "cpu_fallback")
    text = alone.run(["cardcage", "explain", "--num-processes", "2"]).stdout
    assert text.splitlines()[0].startswith("selected 'ddp_spawn'"), text


def test_cardcage_demo_trains(full: Environment) -> None:
    result = full.run(["cardcage", "demo", "--no-progress-bar", "--max-epochs", "1"])
    output = result.stdout + result.stderr
    assert "cardcage: training on 'cpu'" in output
    assert "cardcage: trained 1 epoch(s)" in output


def test_a_two_process_ddp_spawn_fit_matches_the_plain_loop(alone: Environment) -> None:
    script = alone.work / "ddp_spawn_fit.py"
    shutil.copyfile(ROOT / "tests" / "wheels" / "ddp_spawn_fit.py", script)
    result = alone.run(["python", str(script)], timeout=300)
    (line,) = [ln for ln in result.stdout.splitlines() if ln.startswith("{")]
    outcome = json.loads(line)
    assert (outcome["accelerator"], outcome["world_size"]) == ("ddp_spawn", 2)
    assert outcome["global_step"] == 2 * 64 // 16  # epochs * samples / (processes * batch)
    assert outcome["cardcage"].startswith(str(alone.prefix))
    assert outcome["moved"] > 100 * TOLERANCE  # it trained
    assert outcome["difference"] < TOLERANCE, outcome


def test_new_plugin_writes_a_plugin_that_installs_and_passes_its_own_tests(
    full: Environment,
) -> None:
    """Last in this file: it adds a plugin to ``full``."""
    created = full.run(["cardcage", "new-plugin", "acme"])
    assert created.stdout.startswith("created cardcage-acme in cardcage-acme")
    project = full.work / "cardcage-acme"
    # Its `test` extra brings pytest; its requirement on cardcage-core is met by the wheel
    # from dist/ already installed.
    installed = full.run(["python", "-m", "pip", "install", f"{project}[test]"], timeout=600)
    assert "Requirement already satisfied: cardcage-core" in installed.stdout, installed.stdout
    listing = full.cardcage_json("plugins")
    assert "acme" in {row["name"] for row in listing["backends"]}
    result = full.run(["python", "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=project)
    summary = result.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
