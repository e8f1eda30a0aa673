"""Build (once) and cache a Horovod wheel for the torch of a Python environment.

Horovod ships as an sdist only, and its PyTorch extension is tied to the torch it was compiled
against, so cardcage builds it from source and keeps the wheel outside any project, keyed by
the Horovod version and the torch version (``~/.cache/cardcage/horovod/<hvd>-torch<torch>/``).
A second build for the same pair reuses the wheel.

This module ships inside ``cardcage-horovod``: after ``pip install cardcage-horovod``,
``python -m cardcage_horovod.build --install`` is the command the plugin's availability hint
names. It uses the standard library alone, so the repository's noxfile loads it by path into
an environment without torch.

The build, as recorded in ``shared/research/horovod-and-torch-xla.md``:

- ``pip download --no-deps --no-binary :all: horovod==<version>`` (the sdist);
- Horovod 0.28.1 compiles its PyTorch extension as C++14, which PyTorch 2 headers refuse:
  ``set(CMAKE_CXX_STANDARD 14)`` in ``CMakeLists.txt`` and ``horovod/torch/CMakeLists.txt``
  becomes 17 (Horovod's master made the same change after the release);
- CMake 4 refuses Horovod's bundled Gloo: ``CMAKE_POLICY_VERSION_MINIMUM=3.5`` is set, and when
  the ``cmake`` on ``PATH`` is missing, older than 3.13 or 4 and newer, ``cmake<4`` is
  installed into a private folder of the build;
- ``pip wheel --no-build-isolation --no-deps`` with the PyTorch + Gloo settings
  (``HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1
  HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo``); a
  ``HOROVOD_*`` variable already in the environment wins.

Usage::

    python -m cardcage_horovod.build                # build or reuse; print the wheel
    python -m cardcage_horovod.build --install      # ... and install it here
    python -m cardcage_horovod.build --python .venv/bin/python --install

``--install`` installs the wheel with ``--no-deps`` (pip never touches torch) and Horovod's
runtime dependencies (cloudpickle, psutil, pyyaml, packaging, cffi) with torch pinned to the
installed version. ``CARDCAGE_CACHE_DIR`` moves the cache (default ``$XDG_CACHE_HOME/cardcage``
or ``~/.cache/cardcage``). The build takes about 5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HOROVOD_VERSION = "0.28.1"
# The Requires-Dist of the Horovod 0.28.1 wheel (none names torch).
RUNTIME_DEPENDENCIES = ("cloudpickle", "psutil", "pyyaml", "packaging", "cffi>=1.4.0")
BUILD_ENV = {
    "HOROVOD_WITH_PYTORCH": "1",
    "HOROVOD_WITH_GLOO": "1",
    "HOROVOD_WITHOUT_MPI": "1",
    "HOROVOD_WITHOUT_TENSORFLOW": "1",
    "HOROVOD_WITHOUT_MXNET": "1",
    "HOROVOD_CPU_OPERATIONS": "gloo",
}
CXX14 = re.compile(r"set\(CMAKE_CXX_STANDARD 14\)")
CXX_FILES = ("CMakeLists.txt", "horovod/torch/CMakeLists.txt")
PROG = "cardcage_horovod.build"


def log(message: str) -> None:
    print(f"{PROG}: {message}", flush=True)


def cache_root() -> Path:
    """``$CARDCAGE_CACHE_DIR``, else ``$XDG_CACHE_HOME/cardcage``, else ``~/.cache/cardcage``."""
    if os.environ.get("CARDCAGE_CACHE_DIR"):
        return Path(os.environ["CARDCAGE_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cardcage"


def _query(python: str, code: str) -> str:
    return subprocess.run(
        [python, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()


def torch_version(python: str) -> str:
    """The torch version installed for ``python`` (``2.13.0+cpu``); an error without torch."""
    try:
        return _query(python, "import torch; print(torch.__version__)")
    except subprocess.CalledProcessError as error:
        raise SystemExit(
            f"{PROG}: {python} cannot import torch, and Horovod's PyTorch extension is "
            f"built against the installed torch. Install torch first.\n{error.stderr}"
        ) from None


def python_tag(python: str) -> str:
    """``cp311`` for a CPython 3.11 interpreter: the tag of the wheel it can install."""
    return _query(python, "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')")


def cache_dir(version: str, torch: str) -> Path:
    """Where the wheel for Horovod ``version`` built against torch ``torch`` is kept."""
    return cache_root() / "horovod" / f"{version}-torch{torch}"


def cached_wheel(folder: Path, version: str, tag: str) -> Path | None:
    found = sorted(folder.glob(f"horovod-{version}-{tag}-*.whl"))
    return found[-1] if found else None


def patch_cxx17(source: Path) -> list[str]:
    """Make the release compile as C++17 where it asks for C++14; return the files changed."""
    changed = []
    for name in CXX_FILES:
        path = source / name
        text = path.read_text()
        patched = CXX14.sub("set(CMAKE_CXX_STANDARD 17)", text)
        if patched != text:
            path.write_text(patched)
            changed.append(name)
    return changed


def _cmake_version(cmake: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return None
    match = re.search(r"version\s*(\d+)\.(\d+)", out)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _pip(python: str, *args: str, constraints: Path | None = None) -> None:
    command = [python, "-m", "pip", *args]
    if constraints is not None:
        command += ["-c", str(constraints)]
    subprocess.run(command, check=True)


def _torch_constraint(folder: Path, torch: str) -> Path:
    """A constraints file that keeps pip from replacing the installed torch."""
    path = folder / "constraints.txt"
    path.write_text(f"torch=={torch}\n")
    return path


def _private_cmake(python: str, folder: Path) -> str:
    """Install ``cmake<4`` into ``folder`` (not into the environment); return its binary."""
    target = folder / "cmake"
    _pip(python, "install", "--quiet", "--target", str(target), "cmake>=3.13,<4")
    (binary,) = target.glob("cmake/data/bin/cmake")
    return str(binary)


# Prints what ``pip wheel --no-build-isolation`` would miss in the target environment:
# setuptools and packaging (imported by Horovod's setup.py), and wheel where setuptools is
# older than 70.1 (which builds wheels by itself).
_MISSING_BUILD_DEPENDENCIES = """
import importlib.util
missing = [n for n in ("setuptools", "packaging") if importlib.util.find_spec(n) is None]
if not missing and importlib.util.find_spec("wheel") is None:
    import setuptools
    if tuple(int(p) for p in setuptools.__version__.split(".")[:2]) < (70, 1):
        missing.append("wheel")
print(" ".join(missing))
"""


def _build_dependencies(python: str, constraints: Path) -> None:
    """Install what the build takes from ``python``'s environment and it lacks."""
    missing = _query(python, _MISSING_BUILD_DEPENDENCIES).split()
    if missing:
        requirements = ["setuptools>=64" if name == "setuptools" else name for name in missing]
        log(f"installing the build requirements {', '.join(requirements)}")
        _pip(python, "install", "--quiet", *requirements, constraints=constraints)


def build_wheel(python: str, version: str, torch: str, destination: Path) -> Path:
    """Download, patch and build the Horovod sdist; move the wheel into ``destination``."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cardcage-horovod-build-") as temp:
        work = Path(temp)
        constraints = _torch_constraint(work, torch)
        _build_dependencies(python, constraints)
        log(f"downloading the horovod=={version} sdist")
        _pip(
            python,
            "download",
            "--quiet",
            "--no-deps",
            "--no-binary",
            ":all:",
            f"horovod=={version}",
            "-d",
            str(work / "sdist"),
        )
        (archive,) = (work / "sdist").glob("horovod-*.tar.gz")
        with tarfile.open(archive) as tar:
            if hasattr(tarfile, "data_filter"):  # Python 3.10.12+, 3.11.4+
                tar.extractall(work / "src", filter="data")
            else:
                tar.extractall(work / "src")  # older Pythons: no extraction filters
        (source,) = (work / "src").iterdir()
        if int(torch.split(".")[0]) >= 2:
            changed = patch_cxx17(source)
            if changed:
                log(f"C++17 for PyTorch 2 headers: patched {', '.join(changed)}")
        env = dict(os.environ)
        for name, value in BUILD_ENV.items():
            env.setdefault(name, value)
        env.setdefault("CMAKE_POLICY_VERSION_MINIMUM", "3.5")
        env.setdefault("MAKEFLAGS", f"-j{os.cpu_count() or 1}")
        if "HOROVOD_CMAKE" not in env:
            found = _cmake_version("cmake") if shutil.which("cmake") else None
            if found is None or found < (3, 13) or found >= (4, 0):
                log(f"cmake on PATH is {found or 'missing'}: installing cmake<4 for the build")
                env["HOROVOD_CMAKE"] = _private_cmake(python, work)
        settings = " ".join(f"{k}={env[k]}" for k in (*BUILD_ENV, "MAKEFLAGS"))
        log(f"building against torch {torch} with {settings} (about 5 minutes on 2 cores)")
        subprocess.run(
            [
                python,
                "-m",
                "pip",
                "wheel",
                "--no-build-isolation",
                "--no-deps",
                str(source),
                "-w",
                str(work / "wheels"),
            ],
            check=True,
            env=env,
        )
        (built,) = (work / "wheels").glob("horovod-*.whl")
        destination.mkdir(parents=True, exist_ok=True)
        partial = destination / f".{built.name}.partial"
        shutil.copyfile(built, partial)
        final = destination / built.name
        partial.replace(final)  # atomic: a reader never sees half a wheel
    log(f"built {final.name} in {time.monotonic() - started:.0f} s; cached in {destination}")
    return final


def ensure_wheel(
    python: str | None = None, version: str = HOROVOD_VERSION, *, force: bool = False
) -> Path:
    """The cached Horovod wheel for ``python``'s torch, built first when there is none."""
    python = python or sys.executable
    torch = torch_version(python)
    folder = cache_dir(version, torch)
    tag = python_tag(python)
    wheel = None if force else cached_wheel(folder, version, tag)
    if wheel is not None:
        log(f"reusing cached Horovod wheel {wheel}")
        return wheel
    return build_wheel(python, version, torch, folder)


def install(python: str, wheel: Path) -> None:
    """Install ``wheel`` without its dependencies, then Horovod's runtime dependencies."""
    torch = torch_version(python)
    with tempfile.TemporaryDirectory(prefix="cardcage-horovod-") as temp:
        constraints = _torch_constraint(Path(temp), torch)
        _pip(python, "install", "--no-deps", str(wheel))
        _pip(python, "install", *RUNTIME_DEPENDENCIES, constraints=constraints)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--python", default=sys.executable, help="the environment to build for (default: this)"
    )
    parser.add_argument("--version", default=HOROVOD_VERSION, help="the Horovod release")
    parser.add_argument("--force", action="store_true", help="rebuild even when cached")
    parser.add_argument("--install", action="store_true", help="install the wheel (--no-deps)")
    args = parser.parse_args(argv)
    wheel = ensure_wheel(args.python, args.version, force=args.force)
    if args.install:
        install(args.python, wheel)
    print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
