"""The core's layout: subpackages by role, every module in a layer of the import-linter
contracts, no module that only re-exports, no import of a backend plugin, and plugins,
extensions and templates that take cardcage only through its faces.

There is no line limit: a module is as long as its one job needs, and is split along a seam
of responsibility, never to meet a count. The plugin check is the one the `no-plugin-imports`
import-linter contract makes, for every name: import-linter cannot match ``cardcage_*``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tomllib

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


#: The top level of the package: the faces and the leaves every layer may import.
TOP_LEVEL = {"__init__.py", "__main__.py", "_version.py", "errors.py", "sdk.py", "devices.py"}
#: Modules whose job is to gather names from the layers below: the faces.
# The public faces DESIGN.md names: they gather what users import.
FACES = {
    "__init__.py",
    "sdk.py",
    "testing/__init__.py",
    "callbacks/__init__.py",
    "loggers/__init__.py",
}


def test_the_top_level_holds_only_the_faces_and_leaves() -> None:
    files = {path.name for path in PACKAGE.glob("*.py")}
    assert files == TOP_LEVEL, f"top-level modules besides the faces and leaves: {files}"
    assert len(files) <= 8
    subpackages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert subpackages == {
        "cli", "train", "selection", "plugins", "backend",
        "environments", "checkpoints", "config", "testing", "callbacks", "loggers",
    }  # fmt: skip


def _contract(contract_id: str) -> dict[str, object]:
    config = tomllib.loads((REPOSITORY / "pyproject.toml").read_text(encoding="utf-8"))
    contracts = config["tool"]["importlinter"]["contracts"]
    (found,) = [c for c in contracts if c["id"] == contract_id]
    return dict(found)


def _layer_names(contract: dict[str, object]) -> list[str]:
    layers = contract["layers"]
    assert isinstance(layers, list)
    prefix = "".join(f"{c}." for c in contract.get("containers", []))  # type: ignore[attr-defined]
    return [prefix + name.strip() for layer in layers for name in re.split(r"[|:]", layer)]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_under(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


def test_every_module_is_in_a_layer_and_every_layer_exists() -> None:
    """A module outside every layer is unconstrained; a layer naming no module constrains
    nothing. Both contracts: the subpackages', and the finer one inside ``backend``."""
    for contract_id in ("core-layers", "backend-layers"):
        names = _layer_names(_contract(contract_id))
        for name in names:
            relative = Path(*name.split(".")[1:])
            exists = (PACKAGE / relative).with_suffix(".py").is_file() or (
                PACKAGE / relative / "__init__.py"
            ).is_file()
            assert exists, f"{contract_id} names {name}, which is no module of the core"
        container = str(_contract(contract_id).get("containers", ["cardcage"])[0])  # type: ignore[index]
        modules = [_module_name(p) for p in _core_modules()]
        inside = [m for m in modules if m.startswith(container + ".")]
        outside = [m for m in inside if not any(_is_under(m, layer) for layer in names)]
        assert not outside, f"modules in no layer of {contract_id}: {outside}"


def _only_reexports(tree: ast.Module) -> bool:
    """Whether a module's body is a docstring, imports and ``__all__`` only."""
    body = [
        node
        for node in tree.body
        if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
    ]
    imports = [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom))]
    rest = [
        n
        for n in body
        if not isinstance(n, (ast.Import, ast.ImportFrom))
        and not (
            isinstance(n, (ast.Assign, ast.AnnAssign))
            and "__all__" in ast.dump(n.targets[0] if isinstance(n, ast.Assign) else n.target)
        )
    ]
    return bool(imports) and not rest


def test_no_module_only_reexports_names_from_where_they_used_to_be() -> None:
    """Only the faces gather names; anywhere else an ``import X as X`` or a module of imports
    alone is a shim left where a name used to live."""
    shims, aliases = [], []
    for path in _core_modules():
        relative = path.relative_to(PACKAGE).as_posix()
        if relative in FACES:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        if _only_reexports(tree):
            shims.append(relative)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cardcage"):
                aliases += [
                    f"{relative}: {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.asname == alias.name
                ]
    assert not shims, f"modules that only re-export: {shims}"
    assert not aliases, f"names re-exported with 'import X as X': {aliases}"


#: Where code that a plugin author reads or copies lives: it imports cardcage only through
#: its faces.
FACE_USERS = (
    "plugins",
    "extensions",
    "examples/plugin-tutorial",
    "core/src/cardcage/templates",
)
_IMPORT = re.compile(r"^\s*(?:from|import)\s+(cardcage(?:\.[A-Za-z_]\w*)*)", re.M)


def _face_user_files() -> list[Path]:
    files: list[Path] = []
    for folder in FACE_USERS:
        root = REPOSITORY / folder
        files += [p for p in root.rglob("*") if p.suffix in (".py", ".tmpl", ".md")]
    return [p for p in files if ".nox" not in p.parts and "build" not in p.parts]


def test_plugins_extensions_and_templates_use_only_the_faces() -> None:
    """Plugins, extensions, their tests, the tutorial and the new-plugin templates import
    ``cardcage``, ``cardcage.sdk`` and ``cardcage.testing`` (with its modules), nothing else:
    what they need is in those faces, and the core's layout can change under them."""
    files = _face_user_files()
    assert len(files) > 40
    found = [
        f"{path.relative_to(REPOSITORY)}: {module}"
        for path in files
        for module in _IMPORT.findall(path.read_text(encoding="utf-8"))
        if module not in ("cardcage", "cardcage.sdk") and not _is_under(module, "cardcage.testing")
    ]
    assert not found, "imports of the core's insides:\n" + "\n".join(found)
