"""mkdocs hooks for cardcage's documentation (``hooks:`` in mkdocs.yml).

- The hook reference, ``reference/hooks.md``, is generated from the hookspecs in
  ``core/src/cardcage/spec.py``: their signatures and their docstrings. A hook without a
  docstring, or whose docstring leaves a parameter or the return value undocumented, stops
  the build (the same rules as ``core/tests/test_spec.py``).
- A line ``<!-- cardcage:readme plugins/<name>/README.md -->`` in a page is replaced by that
  README, less its title; ``shift=N`` after the path moves its headings N levels down. Its
  links to files outside docs/ become plain text (mkdocs cannot link there), and its links
  into docs/ are made relative to the page.

``spec.py`` is loaded from its file, not imported as ``cardcage.spec``: it needs pluggy alone,
so building the docs does not install torch.
"""

from __future__ import annotations

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
SPEC = ROOT / "core" / "src" / "cardcage" / "spec.py"
REFERENCE = "reference/hooks.md"
README_MARKER = re.compile(
    r"^<!--\s*cardcage:readme\s+(\S+)(?:\s+shift=(\d))?\s*-->\s*$", re.MULTILINE
)


# -- the hook reference ----------------------------------------------------------------------


def load_spec(path: Path = SPEC) -> types.ModuleType:
    """``cardcage.spec`` loaded from ``path`` under a private name (no cardcage import)."""
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
            "the hook reference cannot be generated from core/src/cardcage/spec.py:\n  - "
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
        "<!-- Generated by docs/_hooks/cardcage_docs.py from core/src/cardcage/spec.py. -->",
        "",
        "This page is generated, when the documentation is built, from the hook "
        "specifications in `cardcage.spec` (`core/src/cardcage/spec.py`): their signatures "
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


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """``mkdocs serve`` rebuilds when the hookspecs or the plugin READMEs change."""
    config.watch.append(str(SPEC))
    config.watch.extend(str(path) for path in sorted((ROOT / "plugins").glob("*/README.md")))
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    content = render_reference(load_spec())
    files.append(File.generated(config, REFERENCE, content=content))
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
