"""mkdocs hooks for cardcage's documentation (``hooks:`` in mkdocs.yml).

- The hook reference, ``reference/hooks.md``, is generated from the hookspecs in
  ``core/src/cardcage/plugins/spec.py``: their signatures and their docstrings. A hook without a
  docstring, or whose docstring leaves a parameter or the return value undocumented, stops
  the build (the same rules as ``core/tests/test_spec.py``).
- The SDK reference, ``reference/sdk.md``, is generated from the names that
  ``core/src/cardcage/sdk.py`` exports (``__all__``), grouped as its docstring groups them:
  each name is found, by following ``from cardcage.x import name``, in the module that
  defines it, and shown with its signature, its docstring and, for a class, its public
  attributes and methods. An exported class or function without a docstring stops the build
  (constants are shown as their assignment and need none).
- Both references replace the stand-ins committed at ``docs/reference/``, which point a
  reader of the Markdown sources to the source files, so links to them work there too.
- A line ``<!-- cardcage:readme plugins/<name>/README.md -->`` in a page is replaced by that
  README, less its title; ``shift=N`` after the path moves its headings N levels down. Its
  links to files outside docs/ become plain text (mkdocs cannot link there), and its links
  into docs/ are made relative to the page.

``spec.py`` is loaded from its file, not imported as ``cardcage.plugins.spec``: it needs pluggy
alone, so building the docs does not install torch. The SDK's modules import torch, so they are
only parsed (``ast``), never imported.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import posixpath
import re
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "core" / "src"
SPEC = SOURCE / "cardcage" / "plugins" / "spec.py"
SDK = SOURCE / "cardcage" / "sdk.py"
REFERENCE = "reference/hooks.md"
SDK_REFERENCE = "reference/sdk.md"
README_MARKER = re.compile(
    r"^<!--\s*cardcage:readme\s+(\S+)(?:\s+shift=(\d))?\s*-->\s*$", re.MULTILINE
)


# -- the hook reference ----------------------------------------------------------------------


def load_spec(path: Path = SPEC) -> types.ModuleType:
    """``cardcage.plugins.spec`` loaded from ``path`` under a private name (no cardcage import)."""
    module_spec = importlib.util.spec_from_file_location("_cardcage_docs_spec", path)
    if module_spec is None or module_spec.loader is None:
        raise PluginError(f"cannot load the hookspecs from {path}")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    try:
        module_spec.loader.exec_module(module)
    finally:
        del sys.modules[module_spec.name]
    return module


def hookspecs(module: types.ModuleType) -> dict[str, Callable[..., Any]]:
    """The functions of ``module`` marked as hookspecs, in the order they are defined."""
    marker = f"{module.NAME}_spec"
    return {
        name: function
        for name, function in vars(module).items()
        if callable(function) and hasattr(function, marker)
    }


def _inline(text: str) -> str:
    """reST inline markup of the docstrings as Markdown."""
    text = re.sub(r":\w+:`~[\w.]*?\.?(\w+)`", r"`\1`", text)  # :class:`~a.b.C` -> `C`
    text = re.sub(r":\w+:`([^`]+)`", r"`\1`", text)  # :data:`a.b` -> `a.b`
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def _blocks(text: str) -> str:
    """Paragraphs of a docstring as Markdown; ``para::`` and its indented block as code."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.rstrip().endswith("::"):
            out.append(_inline(line.rstrip()[:-1]))
            i += 1
            block: list[str] = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
                block.append(lines[i])
                i += 1
            code = inspect.cleandoc("\n".join(block))
            out += ["", "```", code, "```", ""]
            continue
        out.append(_inline(line))
        i += 1
    return "\n".join(out).strip()


def _fields(doc: str) -> tuple[str, dict[str, str], str | None]:
    """Split a docstring into its prose, its ``:param x:`` texts and its ``:return:`` text."""
    prose: list[str] = []
    params: dict[str, str] = {}
    returns: str | None = None
    current: list[str] | None = None
    for line in doc.splitlines():
        match = re.match(r":param (\w+):\s*(.*)", line)
        if match:
            params[match[1]] = match[2]
            current = [match[1]]
            continue
        match = re.match(r":returns?:\s*(.*)", line)
        if match:
            returns = match[1]
            current = ["return"]
            continue
        if current is not None and line.startswith(" ") and line.strip():
            if current[0] == "return":
                returns = f"{returns} {line.strip()}"
            else:
                params[current[0]] += f" {line.strip()}"
            continue
        current = None
        prose.append(line)
    return "\n".join(prose).strip(), params, returns


def check_hook(name: str, function: Callable[..., Any]) -> list[str]:
    """What is wrong with a hookspec's documentation or types (empty: nothing)."""
    problems = []
    doc = inspect.getdoc(function) or ""
    if not doc.strip():
        return [f"{name} has no docstring"]
    _, params, returns = _fields(doc)
    signature = inspect.signature(function)
    taken = set(signature.parameters)
    if set(params) != taken:
        problems.append(
            f"{name}: its docstring documents parameters {sorted(params)}, "
            f"but it takes {sorted(taken)}"
        )
    if signature.return_annotation is inspect.Signature.empty:
        problems.append(f"{name} has no return type")
    elif signature.return_annotation not in ("None", None) and returns is None:
        problems.append(f"{name} returns {signature.return_annotation} but has no :return:")
    for parameter in signature.parameters.values():
        if parameter.annotation is inspect.Parameter.empty:
            problems.append(f"{name}: parameter {parameter.name} has no type")
    return problems


def _options(function: Callable[..., Any], marker: str) -> list[str]:
    options = getattr(function, marker, {}) or {}
    return [key for key in ("firstresult", "historic") if options.get(key)]


def _annotation(annotation: Any) -> str:
    """An annotation as written (they are strings: spec.py has ``from __future__ import``)."""
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def render_hook(name: str, function: Callable[..., Any], marker: str) -> str:
    doc = inspect.getdoc(function) or ""
    prose, params, returns = _fields(doc)
    signature = inspect.signature(function)
    options = _options(function, marker)
    decorator = f"@hookspec({', '.join(f'{o}=True' for o in options)})" if options else "@hookspec"
    arguments = ", ".join(
        f"{p.name}: {_annotation(p.annotation)}" for p in signature.parameters.values()
    )
    out = [
        f"## {name}",
        "",
        "```python",
        decorator,
        f"def {name}({arguments}) -> {_annotation(signature.return_annotation)}: ...",
        "```",
        "",
        _blocks(prose),
        "",
    ]
    if params:
        out.append("**Parameters**")
        out.append("")
        for parameter in signature.parameters.values():
            out.append(
                f"- `{parameter.name}` (`{_annotation(parameter.annotation)}`): "
                f"{_inline(params[parameter.name])}"
            )
        out.append("")
    if returns is not None:
        annotation = _annotation(signature.return_annotation)
        out += [f"**Returns** `{annotation}`: {_inline(returns)}", ""]
    if "firstresult" in options:
        out += [
            "**Calling convention**: first result wins. pluggy calls the implementations in "
            "turn, the core's own last, and stops at the first that returns something other "
            "than `None`; that value is the hook's result. Wrappers "
            "(`@cardcage.hookimpl(wrapper=True)`) run around all of them.",
            "",
        ]
    else:
        out += [
            "**Calling convention**: every plugin's implementation is called; pluggy "
            "returns the list of their results that are not `None`.",
            "",
        ]
    return "\n".join(out)


def render_reference(module: types.ModuleType) -> str:
    """The Markdown of the hook reference; raises PluginError for an undocumented hook."""
    hooks = hookspecs(module)
    problems = [problem for name, fn in hooks.items() for problem in check_hook(name, fn)]
    unmarked = sorted(
        name for name in vars(module) if name.startswith(f"{module.NAME}_") and name not in hooks
    )
    problems += [f"{name} looks like a hook but is not marked as a hookspec" for name in unmarked]
    if not hooks:
        problems.append("no hookspec found")
    if problems:
        raise PluginError(
            "the hook reference cannot be generated from core/src/cardcage/plugins/spec.py:\n  - "
            + "\n  - ".join(problems)
        )
    marker = f"{module.NAME}_spec"
    intro = _blocks(inspect.getdoc(module) or "")
    table = ["| hook | first result wins | summary |", "|---|---|---|"]
    for name, function in hooks.items():
        summary = _inline((inspect.getdoc(function) or "").splitlines()[0])
        first = "yes" if "firstresult" in _options(function, marker) else "no"
        table.append(f"| [`{name}`](#{name}) | {first} | {summary} |")
    parts = [
        "# Hook reference",
        "",
        "<!-- Generated by docs/_hooks/cardcage_docs.py from "
        "core/src/cardcage/plugins/spec.py. -->",
        "",
        "This page is generated, when the documentation is built, from the hook "
        "specifications in `cardcage.plugins.spec` (`core/src/cardcage/plugins/spec.py`): "
        "their signatures "
        "and docstrings. [The plugin author guide](../plugins.md#hooks) explains when each "
        "hook is called and how to wrap one.",
        "",
        intro,
        "",
        *table,
        "",
        *(render_hook(name, function, marker) for name, function in hooks.items()),
    ]
    return "\n".join(parts).rstrip() + "\n"


# -- the SDK reference -----------------------------------------------------------------------

ROLE = re.compile(r":\w+:`~?([\w.]+)`")
FIELD = re.compile(r"    ([\w*]+(?: \([^)]*\))?): (.*)")
DEFINITIONS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


class ParsedModule:
    """One module of the core, parsed (never imported): its tree and its lines."""

    def __init__(self, name: str, path: Path):
        self.name = name
        self.path = path
        self.text = path.read_text(encoding="utf-8")
        self.tree = ast.parse(self.text, str(path))
        self.lines = self.text.splitlines()

    def code(self, node: ast.AST) -> str:
        """``node`` as the source spells it (quotes included), on one line."""
        segment = ast.get_source_segment(self.text, node)
        return " ".join(segment.split()) if segment else ast.unparse(node)

    def comments_above(self, lineno: int) -> list[str]:
        """The comment lines right above line ``lineno`` (1-based), as written."""
        first = lineno
        while first > 1 and self.lines[first - 2].strip().startswith("#"):
            first -= 1
        return self.lines[first - 1 : lineno - 1]

    def statement(self, node: ast.stmt) -> list[str]:
        """``node`` as written, with the comments right above it, dedented."""
        start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        end = node.end_lineno or node.lineno
        lines = [*self.comments_above(start), *self.lines[start - 1 : end]]
        return inspect.cleandoc("\n".join(lines)).splitlines()


class SDKSources:
    """The core's modules under ``core/src``, parsed on demand, and where names live."""

    def __init__(self, root: Path = SOURCE):
        self.root = root
        self.modules: dict[str, ParsedModule] = {}

    def module(self, name: str) -> ParsedModule:
        if name not in self.modules:
            base = self.root.joinpath(*name.split("."))
            path = base.with_suffix(".py")
            if not path.is_file():
                path = base / "__init__.py"
            if not path.is_file():
                raise PluginError(f"the SDK reference cannot find the module {name} ({base})")
            self.modules[name] = ParsedModule(name, path)
        return self.modules[name]

    def define(
        self, module: str, name: str, seen: tuple[str, ...] = ()
    ) -> tuple[ParsedModule, ast.stmt]:
        """The statement that defines ``name`` as ``module`` sees it, following
        ``from cardcage.x import name`` to the module that defines it."""
        parsed = self.module(module)
        for node in parsed.tree.body:
            if isinstance(node, DEFINITIONS) and node.name == name:
                return parsed, node
            if isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == name for target in node.targets
            ):
                return parsed, node
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.target.id == name
            ):
                return parsed, node
        for node in parsed.tree.body:
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            if node.module.partition(".")[0] != "cardcage":
                continue
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    where = f"{node.module}.{alias.name}"
                    if where in seen:
                        raise PluginError(f"the SDK reference: {where} imports itself")
                    return self.define(node.module, alias.name, (*seen, where))
        raise PluginError(f"the SDK reference cannot find where {module}.{name} is defined")

    def base_classes(
        self, parsed: ParsedModule, node: ast.ClassDef
    ) -> list[tuple[ParsedModule, ast.ClassDef]]:
        """The bases of ``node`` that the core defines (torch's and the standard library's
        are not followed)."""
        found = []
        for base in node.bases:
            if not isinstance(base, ast.Name):
                continue
            try:
                where, definition = self.define(parsed.name, base.id)
            except PluginError:
                continue
            if isinstance(definition, ast.ClassDef):
                found.append((where, definition))
        return found

    def inherited(
        self, parsed: ParsedModule, node: ast.ClassDef, method: str
    ) -> tuple[ParsedModule, str, ast.FunctionDef | ast.AsyncFunctionDef] | None:
        """The nearest base class of the core that defines ``method``: its module, its name
        and the method."""
        for where, base in self.base_classes(parsed, node):
            for item in base.body:
                if (
                    isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and item.name == method
                ):
                    return where, base.name, item
            found = self.inherited(where, base, method)
            if found is not None:
                return found
        return None


def sdk_exports(tree: ast.Module) -> list[str]:
    """The names of ``__all__`` in a parsed module."""
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
            and isinstance(node.value, (ast.List, ast.Tuple))
        ):
            return [ast.literal_eval(element) for element in node.value.elts]
    raise PluginError("core/src/cardcage/sdk.py has no __all__ list")


def sdk_groups(doc: str, exported: list[str]) -> tuple[str, list[tuple[str, list[str]]]]:
    """The module docstring's prose, and its groups: a line at the margin followed by
    indented lines that name the members (``:class:`Accelerator```). Exported names that no
    group names come last, under "Also exported"."""
    lines = doc.splitlines()
    prose: list[str] = []
    groups: list[tuple[str, list[str]]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        following = lines[i + 1] if i + 1 < len(lines) else ""
        if line.strip() and not line.startswith(" ") and following.startswith("    "):
            body = []
            i += 1
            while i < len(lines) and lines[i].startswith(" "):
                body.append(lines[i])
                i += 1
            names = [m.rpartition(".")[2] for m in ROLE.findall(" ".join(body))]
            groups.append((line.strip(), [n for n in dict.fromkeys(names) if n in exported]))
            continue
        if not groups:
            prose.append(line)
        i += 1
    grouped = {name for _, names in groups for name in names}
    rest = [name for name in exported if name not in grouped]
    if rest:
        groups.append(("Also exported", rest))
    return "\n".join(prose).strip(), groups


def _sdk_inline(text: str, exported: set[str]) -> str:
    """reST inline markup as Markdown; a role naming an exported name links to it."""

    def role(match: re.Match[str]) -> str:
        name = match[1].rpartition(".")[2]
        return f"[`{name}`](#{name})" if name in exported else f"`{match[1].lstrip('~')}`"

    text = ROLE.sub(role, text)
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def _sdk_doc(text: str, exported: set[str]) -> str:
    """A docstring as Markdown: ``para::`` and its indented block as code; a line followed by
    indented ``name: text`` entries (Google style) as a list; other indentation dropped."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        following = lines[i + 1] if i + 1 < len(lines) else ""
        if line.rstrip().endswith("::"):
            out.append(_sdk_inline(line.rstrip()[:-1], exported))
            i += 1
            block: list[str] = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
                block.append(lines[i])
                i += 1
            out += ["", "```python", inspect.cleandoc("\n".join(block)), "```", ""]
            continue
        if line.strip() and not line.startswith(" ") and FIELD.fullmatch(following):
            out += [_sdk_inline(line, exported), ""]
            i += 1
            items: list[list[str]] = []
            while i < len(lines) and lines[i].startswith("    "):
                match = FIELD.fullmatch(lines[i])
                if match and not lines[i].startswith("     "):
                    items.append([match[1], match[2]])
                elif items:
                    items[-1][1] += " " + lines[i].strip()
                i += 1
            out += [f"- `{name}`: {_sdk_inline(text, exported)}" for name, text in items]
            out.append("")
            continue
        out.append(_sdk_inline(line.strip(), exported))
        i += 1
    return "\n".join(out).strip()


def _argument(
    parsed: ParsedModule, arg: ast.arg, default: ast.expr | None = None, star: str = ""
) -> str:
    text = star + arg.arg
    if arg.annotation is not None:
        text += f": {parsed.code(arg.annotation)}"
    if default is not None:
        equals = " = " if arg.annotation is not None else "="
        text += equals + parsed.code(default)
    return text


def _arguments(parsed: ParsedModule, args: ast.arguments) -> str:
    """The parameters as the source writes them (``ast.unparse`` would write ``x: int=1``)."""
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults))
    defaults += args.defaults
    parts = [_argument(parsed, a, d) for a, d in zip(positional, defaults, strict=True)]
    if args.posonlyargs:
        parts.insert(len(args.posonlyargs), "/")
    if args.vararg is not None:
        parts.append(_argument(parsed, args.vararg, star="*"))
    elif args.kwonlyargs:
        parts.append("*")
    kw_defaults = args.kw_defaults
    parts += [_argument(parsed, a, d) for a, d in zip(args.kwonlyargs, kw_defaults, strict=True)]
    if args.kwarg is not None:
        parts.append(_argument(parsed, args.kwarg, star="**"))
    return ", ".join(parts)


def _signature(parsed: ParsedModule, node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    decorators = [f"@{parsed.code(d)}" for d in node.decorator_list]
    returns = f" -> {parsed.code(node.returns)}" if node.returns is not None else ""
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    arguments = _arguments(parsed, node.args)
    return "\n".join([*decorators, f"{prefix} {node.name}({arguments}){returns}"])


def _heading(level: int, text: str, anchor: str) -> str:
    return f"{'#' * level} `{text}` {{ #{anchor} }}"


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any(
        ast.unparse(d.func if isinstance(d, ast.Call) else d).endswith("dataclass")
        for d in node.decorator_list
    )


def _public_target(statement: ast.stmt) -> bool:
    if isinstance(statement, ast.AnnAssign):
        targets = [statement.target]
    elif isinstance(statement, ast.Assign):
        targets = statement.targets
    else:
        return False
    return all(isinstance(t, ast.Name) and not t.id.startswith("_") for t in targets)


def render_sdk_class(
    sources: SDKSources, parsed: ParsedModule, node: ast.ClassDef, exported: set[str]
) -> list[str]:
    """A class: its header with its public attributes and constructor, its docstring, and
    each public method (a method without a docstring shows the one it overrides)."""
    bases = [ast.unparse(b) for b in [*node.bases, *node.keywords]]
    header = [f"@{ast.unparse(d)}" for d in node.decorator_list]
    header.append(f"class {node.name}({', '.join(bases)}):" if bases else f"class {node.name}:")
    body: list[str] = []
    for item in node.body:
        if _public_target(item):
            body += parsed.statement(item)
    own_init = next(
        (i for i in node.body if isinstance(i, ast.FunctionDef) and i.name == "__init__"), None
    )
    if own_init is not None:
        body.append(f"{_signature(parsed, own_init)}: ...")
    elif not _is_dataclass(node):
        inherited = sources.inherited(parsed, node, "__init__")
        if inherited is not None:
            where, base_name, init = inherited
            body += [f"# inherited from {base_name}", f"{_signature(where, init)}: ..."]
    code = [*header, *(f"    {line}" if line else "" for line in body or ["..."])]
    out = [
        _heading(3, node.name, node.name),
        "",
        "```python",
        *code,
        "```",
        "",
        f"Defined in `{parsed.name}`.",
        "",
        _sdk_doc(ast.get_docstring(node) or "", exported),
        "",
    ]
    if "the module docstring" in (ast.get_docstring(node) or ""):
        module_doc = ast.get_docstring(parsed.tree) or ""
        out += [f"The docstring of `{parsed.name}`:", "", _sdk_doc(module_doc, exported), ""]
    for item in node.body:
        if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if item.name.startswith("_"):
            continue
        doc = ast.get_docstring(item)
        note = ""
        if not doc:
            inherited = sources.inherited(parsed, node, item.name)
            if inherited is not None and ast.get_docstring(inherited[2]):
                doc = ast.get_docstring(inherited[2])
                where = f"{inherited[1]}.{item.name}"
                link = f"[`{where}`](#{where})" if inherited[1] in exported else f"`{where}`"
                note = f"Overrides {link}, documented there as:\n\n"
        anchor = f"{node.name}.{item.name}"
        out += [
            _heading(4, anchor, anchor),
            "",
            "```python",
            _signature(parsed, item),
            "```",
            "",
        ]
        if doc:
            out += [note + _sdk_doc(doc, exported), ""]
    return out


def render_sdk_name(
    sources: SDKSources, name: str, exported: set[str]
) -> tuple[list[str], str, str | None]:
    """One exported name: its Markdown, its kind, and what is wrong with it (or None)."""
    parsed, node = sources.define("cardcage.sdk", name)
    doc = ast.get_docstring(node) if isinstance(node, DEFINITIONS) else None
    problem = None
    if isinstance(node, DEFINITIONS) and not (doc or "").strip():
        problem = f"{name} (defined in {parsed.name}) has no docstring"
    if isinstance(node, ast.ClassDef):
        return render_sdk_class(sources, parsed, node, exported), "class", problem
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = [
            _heading(3, name, name),
            "",
            "```python",
            _signature(parsed, node),
            "```",
            "",
            f"Defined in `{parsed.name}`.",
            "",
            _sdk_doc(doc or "", exported),
            "",
        ]
        return lines, "function", problem
    lines = [
        _heading(3, name, name),
        "",
        "```python",
        *parsed.statement(node),
        "```",
        "",
        f"Defined in `{parsed.name}`.",
        "",
    ]
    return lines, "constant", problem


def _summary(sources: SDKSources, name: str, exported: set[str]) -> str:
    """The first sentence of a name's docstring; for a constant, its comment or value."""
    parsed, node = sources.define("cardcage.sdk", name)
    if isinstance(node, DEFINITIONS):
        doc = (ast.get_docstring(node) or "").split("\n\n")[0].replace("\n", " ")
        sentence = re.match(r"(.+?\.)(?:\s|$)", doc)
        text = _sdk_inline(sentence[1] if sentence else doc, exported)
    else:
        comment = " ".join(
            line.strip().lstrip("#:").strip() for line in parsed.comments_above(node.lineno)
        )
        value = getattr(node, "value", None)
        text = (
            _sdk_inline(comment, exported)
            if comment
            else f"`{ast.unparse(value)}`"
            if value
            else ""
        )
    return text.replace("|", "\\|")


def render_sdk_reference(sources: SDKSources | None = None) -> str:
    """The Markdown of the SDK reference; raises PluginError for an undocumented name."""
    sources = sources or SDKSources()
    sdk = sources.module("cardcage.sdk")
    names = sdk_exports(sdk.tree)
    exported = set(names)
    prose, groups = sdk_groups(ast.get_docstring(sdk.tree) or "", names)
    sections: list[str] = []
    table = ["| name | kind | summary |", "|---|---|---|"]
    problems = []
    for title, members in groups:
        sections += [f"## {title}", ""]
        for name in members:
            lines, kind, problem = render_sdk_name(sources, name, exported)
            if problem:
                problems.append(problem)
            sections += lines
            table.append(f"| [`{name}`](#{name}) | {kind} | {_summary(sources, name, exported)} |")
    if problems:
        raise PluginError(
            "the SDK reference cannot be generated from core/src/cardcage/sdk.py:\n  - "
            + "\n  - ".join(problems)
        )
    parts = [
        "# SDK reference",
        "",
        "<!-- Generated by docs/_hooks/cardcage_docs.py from core/src/cardcage/sdk.py. -->",
        "",
        "This page is generated, when the documentation is built, from `cardcage.sdk` "
        "(`core/src/cardcage/sdk.py`): every name it exports, with the signature, the "
        "docstring and, for a class, the public attributes and methods of the module that "
        "defines it. A plugin imports from `cardcage.sdk` and nowhere else in cardcage. "
        "[The plugin author guide](../plugins.md) explains how the pieces fit together.",
        "",
        _sdk_doc(prose, exported),
        "",
        *table,
        "",
        *sections,
    ]
    return "\n".join(parts).rstrip() + "\n"


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """``mkdocs serve`` rebuilds when the hookspecs or the plugin READMEs change."""
    config.watch.append(str(SPEC))
    config.watch.append(str(SDK.parent))  # the SDK reference reads the modules sdk.py names
    config.watch.extend(str(path) for path in sorted((ROOT / "plugins").glob("*/README.md")))
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """The two generated references replace their committed stand-ins, which exist so that a
    link to ``reference/sdk.md`` or ``reference/hooks.md`` also works in the Markdown sources
    (on GitHub, in an editor), where the stand-in points to the source file."""
    for uri, content in (
        (REFERENCE, render_reference(load_spec())),
        (SDK_REFERENCE, render_sdk_reference()),
    ):
        stand_in = files.get_file_from_path(uri)
        if stand_in is not None:
            files.remove(stand_in)
        files.append(File.generated(config, uri, content=content))
    return files


# -- plugin READMEs inside pages -------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _relink(text: str, readme: Path, page: Page, docs_dir: Path, shift: int) -> str:
    """Links of ``readme`` as seen from ``page``: into docs/ relative, elsewhere plain text;
    headings ``shift`` levels down."""

    def replace(match: re.Match[str]) -> str:
        label, target = match[1], match[2]
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            return match[0]  # an absolute URL or an anchor of the README itself
        path, _, anchor = target.partition("#")
        resolved = (readme.parent / path).resolve()
        if resolved.is_relative_to(docs_dir):
            relative = resolved.relative_to(docs_dir).as_posix()
            page_dir = posixpath.dirname(page.file.src_uri)
            href = posixpath.relpath(relative, page_dir or ".")
            return f"[{label}]({href}{'#' + anchor if anchor else ''})"
        return label

    out, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence:
            line = LINK.sub(replace, line)
            if shift and re.match(r"#{1,6} ", line):
                line = "#" * shift + line
        out.append(line)
    return "\n".join(out)


LIST_ITEM = re.compile(r"^(?:[-*+]|\d+\.) ")


def _four_space_lists(text: str) -> str:
    """GitHub-style lists (continuation indented to the item's text, 2 or 3 spaces) as
    Python-Markdown reads them: indented by 4, so that a code block inside an item stays in
    it and the items after it stay a list; after an item of several blocks, the next item
    gets the blank line before it that Python-Markdown needs to see it."""
    out: list[str] = []
    indent = 0  # the column of the current top-level item's text; 0 outside a list
    blocks = False  # the current item has a blank line inside
    fenced = False  # inside a code block outside any list: left as it is
    for line in text.splitlines():
        if fenced or (FENCE.match(line) and not line.startswith(" ")):
            if FENCE.match(line):
                fenced, indent = not fenced, 0
            out.append(line)
            continue
        item = LIST_ITEM.match(line)
        if item:
            if indent and blocks and out and out[-1].strip():
                out.append("")
            indent, blocks = item.end(), False
        elif line.strip() and not line.startswith(" "):
            indent = 0
        elif indent and not line.strip():
            blocks = True
        elif indent and line.startswith(" " * indent) and indent < 4:
            line = " " * (4 - indent) + line
        out.append(line)
    return "\n".join(out)


def include_readme(relative: str, shift: int, page: Page, config: MkDocsConfig) -> str:
    readme = (ROOT / relative).resolve()
    if not readme.is_relative_to(ROOT) or not readme.is_file():
        raise PluginError(f"{page.file.src_uri}: cannot include {relative}: no such file")
    text = readme.read_text(encoding="utf-8")
    text = re.sub(r"\A# .*\n+", "", text)  # the README's title; the page has its own
    text = _four_space_lists(text)
    return _relink(text, readme, page, Path(config.docs_dir).resolve(), shift)


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    return README_MARKER.sub(lambda m: include_readme(m[1], int(m[2] or 0), page, config), markdown)
