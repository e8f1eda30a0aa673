"""docs/inside-the-core.md stays in step with the import-linter layers and with the files.

The page's Mermaid diagram must draw the `core-layers` and `backend-layers` contracts of
pyproject.toml in their order (the backend's inside the ``backend`` subgraph), and its table
must have a row for every subpackage and module of the contracts (and of ``cardcage`` itself),
naming only modules and names that exist under core/src/cardcage. Each check takes the page's
text, so a test can break a copy of it and watch the check fail.
"""

from __future__ import annotations

import ast
import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

REPOSITORY = Path(__file__).resolve().parents[2]
PACKAGE = REPOSITORY / "core" / "src" / "cardcage"
PAGE = REPOSITORY / "docs" / "inside-the-core.md"
PYPROJECT = REPOSITORY / "pyproject.toml"


def contract_layers(contract_id: str) -> list[str]:
    """A `layers` contract's layers, top first, as written (``"a | b"``, ``"a : b"``)."""
    settings = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))
    for contract in settings["tool"]["importlinter"]["contracts"]:
        if contract["id"] == contract_id:
            layers: list[str] = contract["layers"]
            return layers
    raise AssertionError(f"pyproject.toml has no import-linter contract {contract_id!r}")


def layer_modules(layer: str) -> list[str]:
    return [name.strip() for name in re.split(r"[|:]", layer)]


def core_names() -> list[str]:
    """Every module the two contracts name, dotted from ``cardcage``."""
    names = [name for layer in contract_layers("core-layers") for name in layer_modules(layer)]
    backend = contract_layers("backend-layers")
    return names + [
        f"cardcage.backend.{name}" for layer in backend for name in layer_modules(layer)
    ]


# -- the diagram -----------------------------------------------------------------------------


@dataclass
class Diagram:
    labels: dict[str, str]  # node or subgraph id -> label
    parents: dict[str, str | None]  # node or subgraph id -> the subgraph it is declared in
    edges: list[tuple[str, str]]

    def chains(self) -> list[list[str]]:
        """The arrows as chains of labels, each from a box no arrow points at."""
        following: dict[str, str] = {}
        for start, end in self.edges:
            assert start not in following, f"{start!r} points at two boxes: the layers are a line"
            following[start] = end
        targets = {end for _, end in self.edges}
        chains = []
        for start in following:
            if start in targets:
                continue
            chain = [start]
            while chain[-1] in following:
                chain.append(following[chain[-1]])
            chains.append(chain)
        return chains


NODE = re.compile(r'^(\w+)\["([^"]*)"\]$')
SUBGRAPH = re.compile(r'^subgraph (\w+) \["([^"]*)"\]$')


def parse_diagram(page: str) -> Diagram:
    blocks = re.findall(r"^```mermaid\n(.*?)^```$", page, flags=re.M | re.S)
    assert len(blocks) == 1, f"the page has {len(blocks)} mermaid blocks, not one"
    diagram = Diagram({}, {}, [])
    open_subgraphs: list[str] = []
    lines = blocks[0].splitlines()
    assert lines[0] == "flowchart TB", "the layers are drawn top to bottom"
    for raw in lines[1:]:
        line = raw.strip()
        if not line or line.startswith(("%%", "direction ")):
            continue
        if line == "end":
            open_subgraphs.pop()
        elif match := SUBGRAPH.match(line):
            diagram.labels[match[1]] = match[2]
            diagram.parents[match[1]] = open_subgraphs[-1] if open_subgraphs else None
            open_subgraphs.append(match[1])
        elif match := NODE.match(line):
            diagram.labels[match[1]] = match[2]
            diagram.parents[match[1]] = open_subgraphs[-1] if open_subgraphs else None
        elif "-->" in line:
            ids = [part.strip() for part in line.split("-->")]
            diagram.edges.extend(itertools.pairwise(ids))
        else:
            raise AssertionError(f"a mermaid line this test does not read: {line!r}")
    for start, end in diagram.edges:
        assert start in diagram.labels and end in diagram.labels, (start, end)
    return diagram


def drawn(label: str) -> str:
    """A box's label as the contract spells a layer: ``"launch/"`` is ``launch``."""
    return " ".join(part.rstrip("/") for part in label.split())


def check_diagram(page: str) -> None:
    diagram = parse_diagram(page)
    chains = {
        tuple(drawn(diagram.labels[node]) for node in chain): chain for chain in diagram.chains()
    }
    core = tuple(layer.replace("cardcage.", "") for layer in contract_layers("core-layers"))
    backend = tuple(contract_layers("backend-layers"))
    assert set(chains) == {core, backend}, (
        "the diagram's arrows, top first, must be the core-layers and backend-layers contracts"
        f" of pyproject.toml:\n  drawn: {sorted(chains)}\n  contracts: {[core, backend]}"
    )
    backend_box = chains[core][core.index("backend")]
    outside = [node for node in chains[backend] if diagram.parents[node] != backend_box]
    assert not outside, f"backend layers drawn outside the backend subgraph: {outside}"


# -- the table -------------------------------------------------------------------------------


def parse_table(page: str) -> dict[str, list[str]]:
    """The table's rows: dotted name -> the code spans of its last column, outside
    parentheses."""
    rows: dict[str, list[str]] = {}
    header = "| subpackage or module | role | main modules and types |"
    lines = page.splitlines()
    assert header in lines, "the page has no table headed " + header
    for line in lines[lines.index(header) + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        assert len(cells) == 3, f"a row without three cells: {line!r}"
        name = re.fullmatch(r"`([\w.]+)`", cells[0])
        assert name, f"the first cell is not one `dotted.name`: {cells[0]!r}"
        assert name[1] not in rows, f"two rows for {name[1]}"
        # A parenthesised aside (a class's methods, a flag) is prose, not checked.
        rows[name[1]] = re.findall(r"`([^`]+)`", re.sub(r"\([^()]*\)", "", cells[2]))
    return rows


def module_path(dotted: str) -> Path | None:
    """The file of ``cardcage.x.y`` (a module, or a package's ``__init__.py``), if any."""
    base = PACKAGE.parent.joinpath(*dotted.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def resolve(row: str, span: str) -> tuple[str, str | None]:
    """What a span of ``row``'s last column names: (dotted module, name in it or None).

    In a package's row ``launch/workers.WorkerLauncher`` is ``WorkerLauncher`` in the module
    ``<row>.launch.workers``, ``resume`` the module ``<row>.resume``, and a bare name that is
    no module one in the package's ``__init__.py``. In a module's row a span is a name in it.
    """
    path = module_path(row)
    assert path is not None, row
    is_module = path.name != "__init__.py"
    if is_module or ("." not in span and module_path(f"{row}.{span}") is None):
        return row, span.split(".")[0]
    module, _, name = span.partition(".")
    return f"{row}.{module.replace('/', '.')}", name.split(".")[0] or None


def check_table(page: str) -> None:
    rows = parse_table(page)
    named = set(rows)
    problems = []
    for row, spans in rows.items():
        if module_path(row) is None:
            problems.append(f"{row} has a row but is not under core/src/cardcage")
            continue
        for span in spans:
            module, name = resolve(row, span)
            path = module_path(module)
            if path is None:
                problems.append(f"{row}: `{span}` names {module}, which does not exist")
            elif name is not None and name not in top_level_names(path):
                problems.append(f"{row}: `{span}`: {module} has no {name}")
            elif module != row:  # `launch/workers.X` in backend's row names backend.launch
                named.add(".".join(module.split(".")[: row.count(".") + 2]))
    # A module of a contract is named by its own row, or by a span in its package's row.
    for module in sorted(set(core_names()) - named):
        problems.append(f"{module} is in an import-linter contract but not in the table")
    # Every subpackage and module of cardcage has its row (templates/ holds no Python).
    on_disk = {
        f"cardcage.{path.stem}"
        for path in PACKAGE.iterdir()
        if (path.suffix == ".py" and path.stem != "__init__") or (path / "__init__.py").is_file()
    }
    for module in sorted((on_disk | {"cardcage"}) - set(rows)):
        problems.append(f"{module} exists under core/src/cardcage but has no row")
    assert not problems, "docs/inside-the-core.md's table:\n  " + "\n  ".join(problems)


def test_the_contracts_are_where_this_test_looks() -> None:
    assert len(contract_layers("core-layers")) >= 6
    assert "cardcage.backend" in core_names()
    assert "cardcage.backend.accelerator" in core_names()


def test_the_diagram_draws_the_contracts() -> None:
    check_diagram(PAGE.read_text(encoding="utf-8"))


def test_the_table_names_every_subpackage_and_only_real_ones() -> None:
    check_table(PAGE.read_text(encoding="utf-8"))


# -- the checks can fail ---------------------------------------------------------------------


def _swap_lines(page: str, first: str, second: str) -> str:
    assert first in page and second in page
    return page.replace(first, "\0").replace(second, first).replace("\0", second)


def _without_row(page: str, name: str) -> str:
    lines = page.splitlines(keepends=True)
    row = [line for line in lines if line.startswith(f"| `{name}` |")]
    assert len(row) == 1
    return "".join(line for line in lines if line is not row[0])


BROKEN_DIAGRAMS = {
    # two core layers drawn in the wrong order
    "swapped": lambda page: page.replace(
        "selection --> plugins --> backend", "plugins --> selection --> backend"
    ),
    # two backend layers in the wrong order
    "backend swapped": lambda page: page.replace(
        "b_launch --> b_strategy", "b_strategy --> b_launch"
    ),
    # a sibling missing from a box
    "sibling missing": lambda page: page.replace('["cli | sdk | testing"]', '["cli | sdk"]'),
    # `|` (independent) drawn as `:` (may import each other)
    "separator": lambda page: page.replace('["cli | sdk | testing"]', '["cli : sdk : testing"]'),
    # a layer left out of the arrows
    "layer missing": lambda page: page.replace(
        "train --> selection --> plugins", "train --> plugins"
    ),
    # the backend's layers drawn outside its subgraph
    "outside backend": lambda page: _swap_lines(
        page,
        '        b_types["selection_types"]\n',
        '    lower["environments | checkpoints | callbacks | loggers"]\n',
    ),
}


@pytest.mark.parametrize("breaking", BROKEN_DIAGRAMS.values(), ids=BROKEN_DIAGRAMS.keys())
def test_a_diagram_out_of_step_fails(breaking: Callable[[str], str]) -> None:
    page = PAGE.read_text(encoding="utf-8")
    broken = breaking(page)
    assert broken != page
    with pytest.raises(AssertionError):
        check_diagram(broken)


BROKEN_TABLES = {
    "row removed": lambda page: _without_row(page, "cardcage.selection"),
    "top-level module removed": lambda page: _without_row(page, "cardcage.errors"),
    "no such subpackage": lambda page: page.replace(
        "| `cardcage.checkpoints` |", "| `cardcage.checkpointing` |"
    ),
    "no such module": lambda page: page.replace("`loop.fit_loop`", "`loops.fit_loop`"),
    "no such name": lambda page: page.replace("`trainer.Trainer`", "`trainer.Trainr`"),
    "backend layer unnamed": lambda page: page.replace(
        "`engines.EngineStrategy` (torch-xla, vendor runtimes), ", ""
    ),
}


@pytest.mark.parametrize("breaking", BROKEN_TABLES.values(), ids=BROKEN_TABLES.keys())
def test_a_table_out_of_step_fails(breaking: Callable[[str], str]) -> None:
    page = PAGE.read_text(encoding="utf-8")
    broken = breaking(page)
    assert broken != page
    with pytest.raises(AssertionError):
        check_table(broken)


def test_a_contract_changed_without_the_page_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Swapping two layers in (a copy of) pyproject.toml, or adding a subpackage to a
    layer, breaks the page's checks until the page is redrawn."""
    text = PYPROJECT.read_text(encoding="utf-8")
    swapped = _swap_lines(text, '    "cardcage.selection",\n', '    "cardcage.plugins",\n')
    added = text.replace('"cardcage.train",', '"cardcage.train | cardcage.loops",')
    page = PAGE.read_text(encoding="utf-8")
    for changed, check in ((swapped, check_diagram), (added, check_diagram), (added, check_table)):
        assert changed != text
        copy = tmp_path / "pyproject.toml"
        copy.write_text(changed, encoding="utf-8")
        monkeypatch.setattr(f"{__name__}.PYPROJECT", copy)
        with pytest.raises(AssertionError):
            check(page)
