"""The core's layout: no module over 400 lines, and no import of a backend plugin; and each
shipped backend's module, the template a stranger copies, at most 300 lines.

The lines limit keeps each module to one job; a module that outgrows it is split (its public
names re-exported where they were). The plugin check is the one the `no-plugin-imports`
import-linter contract makes, for every name: import-linter cannot match ``cardcage_*``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "cardcage"
PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
MAX_LINES = 400
MAX_PLUGIN_LINES = 300


def _core_modules() -> list[Path]:
    """Every module of the core."""
    return sorted(PACKAGE.rglob("*.py"))


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_the_core_is_where_this_test_looks() -> None:
    assert (PACKAGE / "__init__.py").is_file()
    assert len(_core_modules()) > 20


def test_no_core_module_is_over_400_lines() -> None:
    over = {
        path.relative_to(PACKAGE).as_posix(): _lines(path)
        for path in _core_modules()
        if _lines(path) > MAX_LINES
    }
    assert not over, (
        f"modules over {MAX_LINES} lines (split them; one job per module): "
        + ", ".join(f"{name} ({lines})" for name, lines in sorted(over.items()))
    )


def test_no_backend_module_is_over_300_lines() -> None:
    """The launch and state machinery lives in the core (the SDK): a backend that needs more
    than this is repeating it."""
    modules = sorted(PLUGINS.glob("*/cardcage_*.py")) + sorted(
        PLUGINS.glob("*/cardcage_*/__init__.py")
    )
    assert len(modules) >= 9, modules
    over = {
        path.relative_to(PLUGINS).as_posix(): _lines(path)
        for path in modules
        if _lines(path) > MAX_PLUGIN_LINES
    }
    assert not over, f"backend modules over {MAX_PLUGIN_LINES} lines: {over}"


def _imported_top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


#: The one import of a plugin distribution the core makes: ``cardcage.SlurmJob`` (public since
#: the submit commands were in the core) loads the extension cardcage-submit on first use.
EXTENSION_ALIASES = {"__init__.py": ["cardcage_submit"]}


def test_no_core_module_imports_a_plugin() -> None:
    found = {
        path.relative_to(PACKAGE).as_posix(): sorted(
            name for name in _imported_top_level_names(path) if name.startswith("cardcage_")
        )
        for path in sorted(PACKAGE.rglob("*.py"))
    }
    imports = {name: plugins for name, plugins in found.items() if plugins}
    assert imports == EXTENSION_ALIASES


REPOSITORY = PACKAGE.parents[2]


def _plugin_modules() -> list[Path]:
    """The module of every shipped backend plugin, and of the tutorial's."""
    modules = sorted(REPOSITORY.glob("plugins/*/cardcage_*.py"))
    return [*modules, *sorted(REPOSITORY.glob("examples/plugin-tutorial/cardcage_*.py"))]


def test_plugins_import_cardcage_only_through_the_sdk() -> None:
    """A plugin reads like a template a stranger could copy: everything it takes from
    cardcage comes from ``cardcage.sdk``, never a private name of a core module."""
    assert len(_plugin_modules()) >= 9
    found: dict[str, list[str]] = {}
    for path in _plugin_modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                top = node.module.split(".")[0]
                if top == "cardcage" and node.module != "cardcage.sdk":
                    found.setdefault(path.name, []).append(f"from {node.module} import ...")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "cardcage":
                        found.setdefault(path.name, []).append(f"import {alias.name}")
    assert not found, f"plugins that import cardcage outside cardcage.sdk: {found}"
