"""The checks CI runs: `nox` runs every session, `nox -s cpu` one, `nox -l` lists them.

- lint: ruff check and ruff format --check over the repository, and lint-imports: the
  import contracts of the core (its layers; no import of a backend plugin), configured under
  [tool.importlinter] in pyproject.toml.
- typecheck: mypy (strict, configured in pyproject.toml) over core/, extensions/submit/, every
  backend plugin's module and examples/plugin-tutorial; then over the modules of two fresh
  `cardcage new-plugin` scaffolds (one process, and --distributed).
- core: core/tests, tests/ and extensions/submit/tests with the core, the nine backend
  plugins and the extension cardcage-submit (`cardcage submit`, on submitit) installed.
- docs: the documentation site (mkdocs.yml, docs/) built with `mkdocs build --strict` into
  .nox/docs/tmp/site: any warning fails it, a broken link or anchor included, and so does a
  hook of core/src/cardcage/plugins/spec.py without a docstring (the hook reference is generated
  from them). It installs the `docs` extra of pyproject.toml and pluggy, not torch.
- build: the sdist and wheel of every distribution (the meta-distribution, core, the ten
  plugins, cardcage-submit: thirteen of each) into dist/, emptied first, each wheel built from
  its sdist; then `twine check --strict`, and scripts/release.py's checks: one version
  (core/src/cardcage/_version.py) and the ranges between the distributions, before the build;
  the wheels' contents (templates, py.typed, entry points, READMEs as long descriptions,
  licence files, dependencies), after it.
- wheels (runs build first): tests/wheels, the wheels of dist/ installed, not editable, into
  new virtual environments (`cardcage`, and apart `cardcage-core` with `cardcage-spawn`), with
  torch from its pin, and run from outside the repository: `cardcage plugins`, `explain`,
  `demo`, a 2-process ddp_spawn fit against a plain loop, `cardcage new-plugin` and the
  generated plugin's own tests.
- slurm: tests/slurm on a private two-node SLURM cluster on this machine (the core with the
  cpu, ddp and spawn plugins and cardcage-submit). As root it installs the Debian packages
  slurmctld, slurmd, slurm-client and munge when missing; elsewhere the tests skip with the
  reason.
- cpu, gpu, dp, ddp, ddp2, spawn, horovod, tpu, fsdp (tag `backends`): one session per backend, with
  the core and that one plugin installed and no other, so a plugin can never lean on another
  one by accident; it runs plugins/<name>/tests.
- ray (tag `backends`): plugins/ray/tests with the core, cardcage-ray and Ray (the release
  RAY_ENGINE pins, from the wheelhouse below, downloaded into once) alone, on a two-node Ray
  cluster the tests start on this machine.
- horovod also installs Horovod itself: the builder that ships in cardcage-horovod
  (plugins/horovod/cardcage_horovod/build.py, `python -m cardcage_horovod.build --install` for
  a pip user) builds a wheel for the session's torch (PyTorch + Gloo, about 5 minutes on 2
  cores) once, caches it outside the repository
  (~/.cache/cardcage/horovod/<horovod>-torch<torch>/, or $CARDCAGE_CACHE_DIR), and later runs
  reuse it (the log says "reusing cached Horovod wheel ...").
- bench (not in the default run: benchmarks measure, they do not pass or fail): the
  benchmarks of benchmarks/ against plain PyTorch and PyTorch Lightning (the `bench` extra),
  each in its quick form; `nox -s bench -- overhead --rounds 13` runs one with its own
  arguments. Give it a quiet machine.
- soak (not in the default run: it takes an hour or more): benchmarks/soak.py, 100
  consecutive launches of each launcher (relaunch, spawn, torchrun, srun on the private SLURM
  cluster, horovodrun with the cached Horovod wheel, xmp with the tpu session's torch-xla when
  `nox -s tpu` has made and kept it), half of them beside a CPU hog; `nox -s soak -- --runs 10`
  for fewer. The default run keeps a short form (tests/distributed/test_soak.py).

Every default session together, from a fresh clone through `CI=true .ci/run`, took 51 min 30 s
on this quiet 2-core machine on 2026-12-06 (ten backend sessions, each environment made anew),
with the Horovod wheel and the torch-xla and Ray wheels cached, and 52 min 15 s with nothing
cached; the core session is 17 minutes of it. CI allows 90; a clean clone's run is kept under 60.

Sessions use the interpreter nox runs under and reuse their virtual environments between runs
(`--reuse-venv=no` starts afresh), except where a session removes its environment when it ends:
under CI, or with less than SPARE_DISK left free (about 20 GB for every environment together, 7
of them tpu's; a run that removes them peaks at about 12 GB). torch is pinned once, in
requirements-dev.txt, and the tool versions once, in the `dev` extra of pyproject.toml.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import nox
from packaging.requirements import Requirement

nox.needs_version = ">=2024.4"
nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"
nox.options.error_on_external_run = True

ROOT = Path(__file__).parent
BACKENDS = ("cpu", "gpu", "dp", "ddp", "ddp2", "spawn", "horovod", "tpu", "fsdp")


def _torch_pin() -> str:
    """The torch requirement of requirements-dev.txt (the CPU build that lies on disk)."""
    for line in (ROOT / "requirements-dev.txt").read_text().splitlines():
        if not line.startswith(("#", "-")) and line.strip():
            requirement = Requirement(line.strip())
            if requirement.name == "torch":
                return str(requirement)
    raise RuntimeError("requirements-dev.txt pins no torch")


TORCH = _torch_pin()
# The tools (pytest, ruff, mypy, ...) as the `dev` extra of pyproject.toml pins them.
DEV_EXTRA = nox.project.load_toml(ROOT / "pyproject.toml")["project"]["optional-dependencies"]
TOOLS = {Requirement(spec).name: spec for spec in DEV_EXTRA["dev"]}
# The extension behind `cardcage submit` / `cardcage jobs` (it brings submitit along).
SUBMIT_EXTENSION = "./extensions/submit"
# Every project here builds with hatchling. Installed once per session (with `editables`, which
# hatchling's editable wheels need), it spares pip a throwaway build environment per editable
# project: measured, 30 s of CPU down to 5 s for the core session's nine projects.
BUILD_SYSTEM = nox.project.load_toml(ROOT / "core/pyproject.toml")["build-system"]
BUILD = [*BUILD_SYSTEM["requires"], "editables"]


def _install(session: nox.Session, *projects: str, tools: tuple[str, ...] = ()) -> None:
    """Install torch, the core and ``projects`` (paths) as editables, and ``tools``."""
    session.install(*BUILD)
    editables = [arg for path in ("./core", *projects) for arg in ("-e", path)]
    session.install("--no-build-isolation", TORCH, *editables, *tools)


# A full run's environments take about 20 GB (tpu's alone 7 GB). Each session gives its
# environment back when it ends under CI (a fresh clone reuses none of them) or when fewer than
# this many bytes are left free on the disk, so that the sessions after it still fit; a
# later run makes it again.
SPARE_DISK = 16 * 2**30


def _session(*args: object, **kwargs: object) -> Callable[[Callable[[nox.Session], None]], object]:
    """``nox.session``; the environment is removed when the session ends, passed or failed,
    under CI or when the disk runs short (SPARE_DISK)."""

    def register(function: Callable[[nox.Session], None]) -> object:
        @functools.wraps(function)
        def run(session: nox.Session) -> None:
            try:
                function(session)
            finally:
                _give_back_disk(session)

        return nox.session(*args, **kwargs)(run)  # type: ignore[call-overload]

    return register


def _give_back_disk(session: nox.Session) -> None:
    location = getattr(session.virtualenv, "location", None)
    if not location or not Path(location).is_dir():
        return
    free = shutil.disk_usage(location).free
    if os.environ.get("CI", "").lower() in ("", "0", "false") and free >= SPARE_DISK:
        return
    why = "under CI" if free >= SPARE_DISK else f"{free / 2**30:.1f} GiB left on the disk"
    shutil.rmtree(location, ignore_errors=True)
    session.log(f"removed its environment {location} ({why}); the next run makes it again")


def _testpaths(*paths: str) -> tuple[str, str]:
    """pytest's option for a session's default test paths, as pytest's ``testpaths``: they are
    collected only when the arguments name no path. So ``nox -s core -- FILE`` runs FILE alone,
    and ``nox -s core -- -k NAME`` (options only) still looks through every default path."""
    return "-o", "testpaths=" + " ".join(paths)


@_session()
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the repository; lint-imports over the core."""
    session.install(TOOLS["ruff"], TOOLS["import-linter"])
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    # The contracts ([tool.importlinter] in pyproject.toml) read the source, never import it:
    # the core and the packages the faces contract watches are found on PYTHONPATH, without
    # installing them or torch.
    sources = ("core/src", "extensions/submit/src", "plugins/horovod")
    path = os.pathsep.join(str(ROOT / source) for source in sources)
    session.run("lint-imports", "--no-cache", "--no-logo", env={"PYTHONPATH": path})


@_session()
def typecheck(session: nox.Session) -> None:
    """mypy --strict over what [tool.mypy] lists (the core, extensions/submit, every backend
    plugin's module, the plugin tutorial), then over the two modules `cardcage new-plugin`
    writes (one process, and --distributed): a plugin author's first mypy run must pass."""
    # pytest: cardcage.testing (the conformance kit) is a pytest plugin. The plugins are not
    # installed: mypy finds their modules by path, and horovod/torch_xla are ignored imports.
    _install(session, SUBMIT_EXTENSION, tools=(TOOLS["mypy"], TOOLS["pytest"]))
    session.run("mypy", *session.posargs)
    scaffolds = Path(session.create_tmp()) / "scaffolds"
    shutil.rmtree(scaffolds, ignore_errors=True)
    modules = []
    for name, options in (("scaffold_single", ()), ("scaffold_distributed", ("--distributed",))):
        directory = scaffolds / name
        session.run("cardcage", "new-plugin", name, "--directory", str(directory), *options)
        modules.append(str(directory / f"cardcage_{name}.py"))
    session.run("mypy", *modules)


@_session()
def core(session: nox.Session) -> None:
    """core/tests, tests/, extensions/submit/tests: the core, every backend, cardcage-submit."""
    plugins = (f"./plugins/{name}" for name in BACKENDS)
    # tensorboard (the extra cardcage[tensorboard]) and pyyaml: the loggers' tests read back
    # what TensorBoardLogger and hparams.yaml hold.
    _install(
        session,
        *plugins,
        SUBMIT_EXTENSION,
        tools=(TOOLS["pytest"], "tensorboard", "pyyaml"),
    )
    # The extension must load and register its commands; a failure is an error here.
    session.run("cardcage", "plugins", env={"CARDCAGE_STRICT_PLUGINS": "1"}, silent=True)
    session.run(
        "pytest", *_testpaths("core/tests", "tests", "extensions/submit/tests"), *session.posargs
    )


@_session()
def docs(session: nox.Session) -> None:
    """mkdocs build --strict: the site, with the hook reference generated from
    cardcage.plugins.spec."""
    # docs/_hooks/cardcage_docs.py loads core/src/cardcage/plugins/spec.py by path, which needs
    # pluggy alone: the core's pluggy requirement, without torch.
    core_project = nox.project.load_toml(ROOT / "core/pyproject.toml")["project"]
    pluggy = [d for d in core_project["dependencies"] if Requirement(d).name == "pluggy"]
    session.install(*DEV_EXTRA["docs"], *pluggy)
    site = Path(session.create_tmp()) / "site"
    session.run(
        "mkdocs",
        "build",
        "--strict",
        "--site-dir",
        str(site),
        *session.posargs,
        env={"NO_MKDOCS_2_WARNING": "1"},  # mkdocs-material's banner about its successor
    )
    session.log(f"the site is in {site}")


# Where `nox -s build` leaves the sdists and wheels (emptied first), and the wheels session
# takes them from.
DIST = ROOT / "dist"


@_session()
def build(session: nox.Session) -> None:
    """sdists and wheels of every distribution into dist/, checked (scripts/release.py)."""
    session.install(*BUILD_SYSTEM["requires"], TOOLS["build"], TOOLS["twine"])
    # One version (core/src/cardcage/_version.py) and the ranges it implies, licences, hints.
    session.run("python", "scripts/release.py", "check")
    folders = session.run("python", "scripts/release.py", "list", silent=True)
    shutil.rmtree(DIST, ignore_errors=True)
    for folder in str(folders).split():
        # The sdist, then the wheel built from it (so the sdist is known to be complete), with
        # the session's hatchling: no throwaway build environment per distribution.
        session.run(
            "python", "-m", "build", "--no-isolation", "--outdir", str(DIST), folder, silent=True
        )
    session.run("twine", "check", "--strict", *sorted(str(path) for path in DIST.iterdir()))
    # Contents: templates, py.typed, entry points, READMEs, licences, versions, dependencies.
    session.run("python", "scripts/release.py", "check-dist", str(DIST))


@_session(requires=["build"])
def wheels(session: nox.Session) -> None:
    """tests/wheels: the wheels of dist/ in clean virtual environments, as a pip user has them."""
    # The tests make their own environments; this one only runs pytest.
    session.install(TOOLS["pytest"], "packaging")
    session.run(
        "pytest",
        *_testpaths("tests/wheels"),
        *session.posargs,
        env={"CARDCAGE_WHEELS_TESTS": "1", "CARDCAGE_DIST": str(DIST)},
    )


@_session()
def slurm(session: nox.Session) -> None:
    """tests/slurm: srun, sbatch, requeue and `cardcage submit` grids on a private SLURM
    cluster the tests start."""
    plugins = ("./plugins/cpu", "./plugins/ddp", "./plugins/spawn", "./plugins/fsdp")
    _install(session, *plugins, SUBMIT_EXTENSION, tools=(TOOLS["pytest"],))
    slurm_env = {"CARDCAGE_SLURM_TESTS": "1"}
    session.run("pytest", *_testpaths("tests/slurm"), *session.posargs, env=slurm_env)


# Prints the entry points of the group `cardcage` and fails unless `name` is the only one.
ONLY_PLUGIN = """
import importlib.metadata, sys
found = sorted(ep.name for ep in importlib.metadata.entry_points(group="cardcage"))
print("cardcage plugins installed:", ", ".join(found) or "none")
if found != [sys.argv[1]]:
    sys.exit(f"expected the {sys.argv[1]!r} plugin alone, found {found}")
"""


def _horovod(session: nox.Session) -> None:
    """Horovod for the session's torch: the cached wheel (built first when there is none),
    installed with --no-deps so that pip never touches torch, and its runtime dependencies."""
    # The builder that ships in cardcage-horovod (`python -m cardcage_horovod.build`); it uses
    # the standard library alone, so it loads by path here, without torch.
    spec = importlib.util.spec_from_file_location(
        "cardcage_horovod_build", ROOT / "plugins/horovod/cardcage_horovod/build.py"
    )
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    wheel = build.ensure_wheel(str(Path(session.bin) / "python"))
    session.install("--no-deps", str(wheel))
    session.install(*build.RUNTIME_DEPENDENCIES, TORCH)  # torch stays the pinned one
    session.run("horovodrun", "--check-build")


# A backend's heavy dependency, installed into its session after the core and the plugin.
ENGINES: dict[str, Callable[[nox.Session], None]] = {"horovod": _horovod}


def _backend_session(name: str) -> None:
    def session_function(session: nox.Session) -> None:
        _install(session, f"./plugins/{name}", tools=(TOOLS["pytest"],))
        if name in ENGINES:
            ENGINES[name](session)
        session.run("python", "-c", ONLY_PLUGIN, name)
        # The plugin must load and register; a failure is an error here, not a skip.
        session.run("cardcage", "plugins", env={"CARDCAGE_STRICT_PLUGINS": "1"})
        session.run("pytest", *_testpaths(f"plugins/{name}/tests"), *session.posargs)

    session_function.__doc__ = f"plugins/{name}/tests, with the core and cardcage-{name} alone."
    _session(name=name, tags=["backends"])(session_function)


for _name in BACKENDS:
    if _name != "tpu":  # torch-xla needs its own torch: the session below
        _backend_session(_name)


# torch-xla 2.9.0 is built against torch 2.9.0 and needs exactly that release (it does not
# declare it): the pair is pinned once, as the `engine` extra of plugins/tpu/pyproject.toml.
# From PyPI, torch 2.9.0 for x86_64 is the CUDA build with its nvidia-* wheels: about 3.5 GB
# of downloads and 7 GB installed.
TPU_PROJECT = nox.project.load_toml(ROOT / "plugins/tpu/pyproject.toml")["project"]
TPU_ENGINE = tuple(TPU_PROJECT["optional-dependencies"]["engine"])
# The engine's wheels, downloaded once and installed from disk afterwards. pip's own HTTP cache
# cannot do this where a proxy strips the caching headers (as here: nothing is ever cached).
WHEELHOUSE = Path(
    os.environ.get("CARDCAGE_WHEELHOUSE") or Path.home() / ".cache" / "cardcage" / "wheelhouse"
)


@_session(tags=["backends"])
def tpu(session: nox.Session) -> None:
    """plugins/tpu/tests on XLA's CPU device, with the core, cardcage-tpu and torch-xla alone.

    Runs with PJRT_DEVICE=CPU. Its own torch (2.9.0, the release torch-xla 2.9.0 is built
    for) is installed from a wheelhouse, downloaded into on the first run only; a reused
    environment skips the install altogether.
    """
    wanted = " ".join(TPU_ENGINE)
    if _engine(session) != wanted:
        from_wheelhouse = ("--no-index", "--find-links", str(WHEELHOUSE), *TPU_ENGINE)
        # Offline first; only a wheelhouse that lacks a wheel sends pip to the index.
        session.run("python", "-m", "pip", "install", *from_wheelhouse, success_codes=[0, 1])
        if _engine(session) != wanted:
            session.run("python", "-m", "pip", "download", "-q", "-d", str(WHEELHOUSE), *TPU_ENGINE)
            session.install(*from_wheelhouse)
    session.install(*BUILD)
    session.install("--no-build-isolation", "-e", "./core", "-e", "./plugins/tpu", TOOLS["pytest"])
    env = {"PJRT_DEVICE": "CPU"}
    session.run("python", "-c", ONLY_PLUGIN, "tpu")
    session.run("cardcage", "plugins", env={**env, "CARDCAGE_STRICT_PLUGINS": "1"})
    session.run("pytest", *_testpaths("plugins/tpu/tests"), *session.posargs, env=env)


def _engine(session: nox.Session) -> str:
    """``torch==X torch-xla==Y`` as installed in the session's environment, or ``""``."""
    output = session.run("python", "-c", ENGINE_VERSIONS, silent=True, success_codes=[0, 1])
    return str(output or "").strip()


ENGINE_VERSIONS = """
import importlib.metadata as m
try:
    print(f"torch=={m.version('torch')} torch-xla=={m.version('torch-xla')}")
except m.PackageNotFoundError:
    raise SystemExit(1)
"""


# The Ray release the ray session tests against (cardcage-ray asks for ray>=2.9), with its
# dependencies, from the wheelhouse: downloaded once (about 80 MB), installed from disk after.
RAY_ENGINE = ("ray==2.60.0", "cloudpickle")


@_session(tags=["backends"])
def ray(session: nox.Session) -> None:
    """plugins/ray/tests with the core, cardcage-ray and Ray alone, on a two-node Ray cluster
    the tests start on this machine (and local Rays the jobs start themselves)."""
    from_wheelhouse = ("--no-index", "--find-links", str(WHEELHOUSE), *RAY_ENGINE)
    # Offline first; only a wheelhouse that lacks a wheel sends pip to the index.
    session.run("python", "-m", "pip", "install", *from_wheelhouse, success_codes=[0, 1])
    probe = "import importlib.metadata as m; print(m.version('ray'))"
    version = session.run("python", "-c", probe, silent=True, success_codes=[0, 1])
    if str(version or "").strip() != RAY_ENGINE[0].partition("==")[2]:
        session.run("python", "-m", "pip", "download", "-q", "-d", str(WHEELHOUSE), *RAY_ENGINE)
        session.install(*from_wheelhouse)
    _install(session, "./plugins/ray", tools=(TOOLS["pytest"],))
    session.run("python", "-c", ONLY_PLUGIN, "ray")
    session.run("cardcage", "plugins", env={"CARDCAGE_STRICT_PLUGINS": "1"})
    session.run("pytest", *_testpaths("plugins/ray/tests"), *session.posargs)


BENCHMARKS = {
    "discovery": ("--rounds", "5"),
    "overhead": ("--quick",),
    "ddp": ("--quick",),
    "instructions": ("--short", "50", "--long", "100"),
}


@_session(default=False)
def bench(session: nox.Session) -> None:
    """benchmarks/*.py against plain PyTorch and Lightning; ``-- NAME [ARGS]`` runs one."""
    plugins = ("./plugins/cpu", "./plugins/ddp", "./plugins/spawn")
    _install(session, *plugins, tools=tuple(DEV_EXTRA["bench"]))
    if session.posargs:
        name, *arguments = session.posargs
        if name not in BENCHMARKS:
            session.error(f"no benchmark {name!r}: choose from {', '.join(BENCHMARKS)}")
        session.run("python", f"benchmarks/{name}.py", *arguments)
        return
    for name, arguments in BENCHMARKS.items():
        if name == "instructions" and not shutil.which("valgrind"):
            session.log("instructions: skipped, valgrind is not installed")
            continue
        session.run("python", f"benchmarks/{name}.py", *arguments)


@_session(default=False)
def soak(session: nox.Session) -> None:
    """benchmarks/soak.py: 100 launches of every launcher, quiet and beside a CPU hog."""
    plugins = ("./plugins/cpu", "./plugins/ddp", "./plugins/spawn", "./plugins/horovod")
    # soak.py finds leftover processes with the conformance kit, which imports pytest.
    _install(session, *plugins, tools=(TOOLS["pytest"],))
    _horovod(session)
    python = str(Path(session.bin) / "python")
    arguments = session.posargs or ["--runs", "100"]
    launchers = "relaunch,spawn,torchrun,srun,horovodrun,xmp"
    session.run(
        "python",
        "benchmarks/soak.py",
        "--launchers",
        launchers,
        "--horovod-python",
        python,
        *arguments,
    )
