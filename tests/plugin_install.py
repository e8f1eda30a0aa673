"""Helpers for the tests that pip-install throwaway cardcage plugins and run them.

tests/test_third_party_plugin.py, tests/test_new_plugin.py and tests/test_plugin_tutorial.py
install plugin distributions with ``pip install --no-deps --target`` into a temporary
directory and run ``python -m cardcage`` (or a script) in fresh processes with that directory
on ``PYTHONPATH``, so the test environment itself is never modified.

pytest's importlib import mode (pyproject.toml) does not put tests/ on ``sys.path``;
tests/conftest.py imports this module so that those test files can ``import plugin_install``.
core/tests load it by its path (core/tests/plugins/test_plugin_manager.py puts the plugins it
installs on ``sys.path`` for one test); :func:`environment_without` makes an environment that
lacks a distribution this one has.
"""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import os
import subprocess
import sys
import sysconfig
import venv
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath

import pytest

# The variables that steer plugins or backend selection in the parent, which a child must not
# inherit; each test file adds its own (its plugin's variables, say).
STEERING_PREFIXES = ("CARDCAGE_", "PL_TRAINER_", "SLURM_", "TORCHELASTIC_", "OMPI_", "PMI_")
STEERING_PREFIXES += ("PMIX_", "HOROVOD_")
STEERING_NAMES = ("WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "PYTHONPATH")
STEERING_NAMES += ("MASTER_ADDR", "MASTER_PORT", "PJRT_DEVICE")


def child_env(
    paths: Sequence[Path],
    prefixes: tuple[str, ...],
    names: tuple[str, ...],
    /,
    **extra: str,
) -> dict[str, str]:
    """The parent's environment without the variables whose name starts with one of
    ``prefixes`` or is one of ``names``, on no GPU, with ``paths`` as ``PYTHONPATH``, and
    ``extra`` set."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(prefixes) and key not in names
    }
    env["CUDA_VISIBLE_DEVICES"] = ""  # a GPU host behaves like a CPU one
    env["PYTHONPATH"] = os.pathsep.join(map(str, paths))
    env.update(extra)
    return env


def describe(result: subprocess.CompletedProcess[str]) -> str:
    return (
        f"$ {' '.join(map(str, result.args))}\nexit {result.returncode}\n"
        f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    )


def run_python(
    args: Sequence[str], cwd: Path, env: Mapping[str, str], timeout: int
) -> subprocess.CompletedProcess[str]:
    """``python <args>`` in ``cwd``, whatever its exit status."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def run(
    args: Sequence[str], cwd: Path, env: Mapping[str, str], timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    """``python <args>`` in ``cwd``, which must exit 0."""
    result = run_python(args, cwd, env, timeout)
    assert result.returncode == 0, describe(result)
    return result


def pip_install(target: Path, sources: Sequence[Path], what: str) -> None:
    """``pip install --no-deps --target``, without build isolation when hatchling is here;
    the test fails, naming ``what`` and every attempt, when it cannot install."""
    base = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check"]
    base += ["--quiet", "--target", str(target), *map(str, sources)]
    attempts = [base]
    if importlib.util.find_spec("hatchling") is not None:
        attempts.insert(0, [*base, "--no-build-isolation"])
    failures = []
    for command in attempts:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        if result.returncode == 0:
            return
        failures.append(describe(result))
    pytest.fail(f"could not pip-install {what}:\n" + "\n".join(failures))


def plugin_source(
    root: Path,
    entry_point: str,
    module_source: str,
    *,
    distribution: str | None = None,
    module: str | None = None,
) -> Path:
    """A source tree of the plugin distribution ``distribution`` (``cardcage-<entry_point>``
    unless given): one module, ``module`` (``cardcage_<entry_point>`` unless given) holding
    ``module_source``, registered under that entry point, built by hatchling. Returns the
    folder to give :func:`pip_install`. A distribution of another name registers a taken
    entry point name without shadowing the installed distribution or module of that name."""
    distribution = distribution or f"cardcage-{entry_point}"
    module = module or f"cardcage_{entry_point}"
    folder = root / distribution
    folder.mkdir(parents=True)
    (folder / "pyproject.toml").write_text(
        "[build-system]\n"
        'requires = ["hatchling>=1.18"]\n'
        'build-backend = "hatchling.build"\n\n'
        "[project]\n"
        f'name = "{distribution}"\n'
        'version = "0.1.0"\n'
        'requires-python = ">=3.10"\n\n'
        "[project.entry-points.cardcage]\n"
        f'{entry_point} = "{module}"\n\n'
        "[tool.hatch.build.targets.wheel]\n"
        f'only-include = ["{module}.py"]\n'
    )
    (folder / f"{module}.py").write_text(module_source)
    return folder


def environment_without(root: Path, distributions: Sequence[str]) -> Path:
    """A virtual environment at ``root`` holding what this interpreter's environment holds
    less ``distributions``; returns its ``python``.

    Its site-packages links to every entry of this environment's except the top-level entries
    those distributions installed there (their metadata, modules and ``.pth`` files, as their
    RECORD lists them; a folder they share with another distribution would go too), so they
    are really not installed there, and torch and the rest are not installed again. Run it
    with :func:`child_env`'s environment.
    """
    skipped: set[str] = set()
    for name in distributions:
        dist = metadata.distribution(name)
        tops = {PurePosixPath(str(file)).parts[0] for file in dist.files or ()} - {".."}
        assert tops, f"{name} lists no files in its RECORD, so they cannot be left out"
        skipped |= tops
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    here = {Path(sysconfig.get_path(key)) for key in ("purelib", "platlib")}
    paths = {"base": str(root), "platbase": str(root)}
    for key in ("purelib", "platlib"):
        target = Path(sysconfig.get_path(key, vars=paths))
        for source in here:
            for entry in source.iterdir():
                if entry.name not in skipped and not (target / entry.name).exists():
                    (target / entry.name).symlink_to(entry)
    return root / "bin" / "python"
