"""The package's modules import each other in one direction only (no import circle, lazy or
under TYPE_CHECKING), and none imports the core's command line."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import cardcage_submit

PACKAGE = Path(cardcage_submit.__file__).parent


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (functions and TYPE_CHECKING included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_no_module_imports_the_core_cli() -> None:
    for path in PACKAGE.glob("*.py"):
        assert "cardcage.cli.main" not in imports(path), path.name


def test_the_modules_form_no_import_circle() -> None:
    graph = {
        path.stem: {
            name.removeprefix("cardcage_submit.")
            for name in imports(path)
            if name.startswith("cardcage_submit.")
        }
        for path in PACKAGE.glob("*.py")
        if path.stem != "__init__"
    }
    graphlib.TopologicalSorter(graph).static_order()  # raises CycleError on a circle
    assert "submission" not in graph["plan"]
    assert "plan" in graph["submission"]
