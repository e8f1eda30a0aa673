"""The core's layout: no import of a backend plugin, and plugins that take cardcage only
through ``cardcage.sdk``.

There is no line limit: a module is as long as its one job needs, and is split along a seam
of responsibility, never to meet a count. The plugin check is the one the `no-plugin-imports`
import-linter contract makes, for every name: import-linter cannot match ``cardcage_*``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "cardcage"
PLUGINS = Path(__file__).resolve().parents[2] / "plugins"


def _core_modules() -> list[Path]:
    """Every module of the core."""
    return sorted(PACKAGE.rglob("*.py"))


def test_the_core_is_where_this_test_looks() -> None:
    assert (PACKAGE / "__init__.py").is_file()
    assert len(_core_modules()) > 20


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
