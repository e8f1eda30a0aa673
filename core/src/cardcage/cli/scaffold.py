"""``cardcage new-plugin NAME``: write a new backend plugin distribution to start from.

The distribution ``cardcage-NAME`` holds one module ``cardcage_NAME.py`` (an
:class:`~cardcage.Accelerator` subclass with a rule, an availability, and a
``setup_environment`` and ``setup_module`` that really train, on the CPU, with the core's
loop or a ``cardcage.Cage``; with ``--distributed``, a
:class:`~cardcage.sdk.DistributedAccelerator` that trains one rank per process), its
``pyproject.toml`` (hatchling, the entry point ``NAME = "cardcage_NAME"`` in the group
``cardcage``), a README, tests that pass as written (the conformance kit included), and a
``noxfile.py`` whose session runs them with the core and the plugin alone.
The templates are files under ``cardcage/templates/plugin/``, filled in with
:class:`string.Template` (``$name``, ``$module``, ...).
"""

from __future__ import annotations

import importlib.metadata as metadata
import keyword
import os
import re
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from string import Template

from cardcage._version import __version__
from cardcage.errors import MisconfigurationError

#: The default order of the new backend's rule: after a single GPU (600), before the CPU
#: fallback (1000).
DEFAULT_ORDER = 700
#: The default order of a distributed backend's rule: after several GPUs (400), before
#: ddp_spawn's claim on several CPU processes (500), which would otherwise take its jobs.
DISTRIBUTED_ORDER = 450
NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]*")
MAX_NAME_LENGTH = 24
#: Names the shipped backends use (canonical names, aliases and entry-point names), and
#: ``core``, whose distribution ``cardcage-core`` is the core itself.
RESERVED_NAMES = frozenset(
    {"cpu", "gpu", "dp", "ddp", "ddp2", "ddp_spawn", "spawn", "ddp_cpu", "horovod", "tpu"}
    | {"core"}
)
#: Template file (under ``templates/plugin``) → path in the new distribution.
FILES = {
    "pyproject.toml.tmpl": "pyproject.toml",
    "module.py.tmpl": "{module}.py",
    "README.md.tmpl": "README.md",
    "noxfile.py.tmpl": "noxfile.py",
    "test_plugin.py.tmpl": "tests/test_{name}.py",
    "test_conformance.py.tmpl": "tests/test_conformance.py",
}
#: What ``--distributed`` writes instead of the single-process module and tests.
DISTRIBUTED = {
    "module.py.tmpl": "module_distributed.py.tmpl",
    "test_plugin.py.tmpl": "test_plugin_distributed.py.tmpl",
}
#: The conformance kit's launches of each kind of plugin (``$launches`` in the template).
LAUNCHES = {
    False: '"in_process": Launch({"distributed_backend": NAME}),',
    True: '"two_processes": Launch({"distributed_backend": NAME, "num_processes": 2}, '
    "world_size=2),",
}

#: The README's sentences that differ between the two kinds of plugin (``$flag``,
#: ``$summary``, ``$nodes``, ``$tests`` and ``$subclass`` in the template).
README = {
    False: {
        "flag": "",
        "summary": "It trains in the calling process on the CPU, with the core's training loop,\n"
        "the way the `cpu` backend does; make `$module.py` train on your device.",
        "nodes": "It trains one process: with `num_nodes > 1` it is an error that says to\n"
        "  use `ddp`.",
        "tests": 'They train a small model through `Trainer(distributed_backend="$name")`\n'
        "against a plain PyTorch loop; the conformance kit (`tests/test_conformance.py`) trains\n"
        "it in this process and checks its checkpoints and failures.",
        "subclass": "Subclass `DistributedAccelerator` (from `cardcage.sdk`) for one\n"
        "  `torch.distributed` rank per process: `cardcage new-plugin --distributed` starts there.",
    },
    True: {
        "flag": " --distributed",
        "summary": "It trains `num_processes` processes per node, one `torch.distributed`\n"
        "rank each (gloo on the CPU, NCCL on GPUs), its model wrapped in DistributedDataParallel,\n"
        "the way the `ddp` backend does; make `$module.py` train on your device.",
        "nodes": "It trains one rank per process on one node or several (`num_nodes`), the\n"
        "  processes started by its launcher (`ScriptLauncher`), by torchrun or by SLURM.",
        "tests": "The conformance kit (`tests/test_conformance.py`) trains it in two processes\n"
        "against a plain PyTorch loop and checks its checkpoints and failures.",
        "subclass": "It subclasses `DistributedAccelerator`, imported from `cardcage.sdk` like\n"
        "  every name it uses; override `setup_environment`, `setup_module`, `wrap` or\n"
        "  `launcher` there.",
    },
}


@dataclass(frozen=True)
class PluginNames:
    """Every name of a new plugin, derived from its backend name."""

    name: str  # backend name and entry-point name: "my_npu"
    distribution: str  # "cardcage-my-npu"
    module: str  # "cardcage_my_npu"
    class_name: str  # "MyNpuAccelerator"
    switch: str  # the environment variable of its rule: "MY_NPU"
    order: int
    core_requirement: str  # "cardcage-core>=0.1,<0.2"
    distributed: bool = False  # one process (the cpu-like template) or one per rank


def _core_requirement() -> str:
    major, minor = (int(part) for part in __version__.split(".")[:2])
    return f"cardcage-core>={major}.{minor},<{major}.{minor + 1}"


def _installed_plugin(name: str) -> str | None:
    """The distribution that already provides the entry point ``name``, if one does."""
    for ep in metadata.entry_points(group="cardcage"):
        if ep.name == name:
            dist = getattr(ep, "dist", None)
            return f"{dist.name} {dist.version}" if dist is not None else ep.value
    return None


def plugin_names(name: str, order: int | None = None, distributed: bool = False) -> PluginNames:
    """Check ``name`` and ``order`` and derive the plugin's names.

    ``order`` defaults to :data:`DEFAULT_ORDER`, or :data:`DISTRIBUTED_ORDER` for a
    distributed backend. Raises :class:`~cardcage.MisconfigurationError` for a name that is
    not a lower-case identifier, a shipped backend's name, or an installed plugin's, and for
    an order below 1.
    """
    if order is None:
        order = DISTRIBUTED_ORDER if distributed else DEFAULT_ORDER
    for prefix in ("cardcage-", "cardcage_"):
        if name.startswith(prefix) and len(name) > len(prefix):
            raise MisconfigurationError(
                f"new-plugin NAME={name!r} includes the prefix {prefix!r}: NAME is the backend "
                f"name alone, and the distribution is named 'cardcage-NAME'. Use "
                f"NAME={name[len(prefix) :]!r}."
            )
    if not NAME_PATTERN.fullmatch(name) or keyword.iskeyword(name) or len(name) > MAX_NAME_LENGTH:
        raise MisconfigurationError(
            f"new-plugin NAME={name!r} is not a backend name: use lower-case letters, digits "
            f"and underscores, starting with a letter, at most {MAX_NAME_LENGTH} characters, "
            "not a Python keyword (for example 'acme' or 'my_npu')."
        )
    if name in RESERVED_NAMES:
        raise MisconfigurationError(
            f"new-plugin NAME={name!r} is taken by a backend that ships with cardcage (or by "
            "the core). Pick another NAME, such as the name of your device or cluster."
        )
    installed = _installed_plugin(name)
    if installed is not None:
        raise MisconfigurationError(
            f"new-plugin NAME={name!r} is already the name of an installed cardcage plugin "
            f"({installed}); two plugins of one name cannot both load. Pick another NAME, or "
            f"uninstall that plugin first."
        )
    if isinstance(order, bool) or not isinstance(order, int) or order < 1:
        raise MisconfigurationError(
            f"--order={order!r} is not a rule order: use a positive integer. Rules run in "
            "ascending order (horovod 100, tpu 200, ddp 300, ddp_spawn 400 and 500, gpu 600, "
            f"cpu 1000); the default, {DEFAULT_ORDER}, comes after a single GPU and before the "
            f"CPU fallback, and with --distributed, {DISTRIBUTED_ORDER}, before ddp_spawn's "
            "claim on several CPU processes."
        )
    words = name.split("_")
    return PluginNames(
        name=name,
        distribution="cardcage-" + name.replace("_", "-"),
        module=f"cardcage_{name}",
        class_name="".join(word[:1].upper() + word[1:] for word in words) + "Accelerator",
        switch=name.upper(),
        order=order,
        core_requirement=_core_requirement(),
        distributed=distributed,
    )


def render(names: PluginNames) -> dict[str, str]:
    """The new distribution's files: relative path → text."""
    folder = resources.files("cardcage").joinpath("templates", "plugin")
    values = {key: str(value) for key, value in asdict(names).items()}
    values["launches"] = LAUNCHES[names.distributed]
    values |= {
        key: Template(text).substitute(values) for key, text in README[names.distributed].items()
    }
    chosen = DISTRIBUTED if names.distributed else {}
    return {
        target.format(module=names.module, name=names.name): Template(
            folder.joinpath(chosen.get(source, source)).read_text(encoding="utf-8")
        ).substitute(values)
        for source, target in FILES.items()
    }


def new_plugin(
    name: str,
    directory: str | os.PathLike[str] | None = None,
    order: int | None = None,
    distributed: bool = False,
) -> tuple[PluginNames, Path, list[str]]:
    """Write the distribution ``cardcage-NAME`` into ``directory``.

    ``directory`` defaults to ``./cardcage-NAME``; it must not exist, or be empty: no file
    is ever overwritten. Returns the names, the directory and the files written (relative
    paths). Raises :class:`~cardcage.MisconfigurationError` for a bad name, order or
    directory, before writing anything.
    """
    names = plugin_names(name, order, distributed)
    target = Path(directory) if directory is not None else Path(names.distribution)
    where = (
        f"--directory={str(target)!r}"
        if directory is not None
        else (f"the directory {str(target)!r} (the default of --directory)")
    )
    if target.exists() and not target.is_dir():
        raise MisconfigurationError(
            f"{where} is a file. Name a directory that does not exist yet with --directory."
        )
    if target.is_dir() and any(target.iterdir()):
        raise MisconfigurationError(
            f"{where} already exists and is not empty, and new-plugin never overwrites "
            "files. Name a new or empty directory with --directory, or remove that one."
        )
    files = render(names)
    for relative, text in files.items():
        path = target / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return names, target, list(files)
