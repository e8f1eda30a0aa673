"""``cardcage new-plugin``: the names it derives, the files it writes, what it refuses.

In-process and fast, but for one (slow) that pip-installs a throwaway plugin whose name is
then refused; tests/test_new_plugin.py installs a generated plugin and trains with it.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import tomllib

import cardcage
from cardcage import MisconfigurationError
from cardcage.cli import main as cli
from cardcage.cli import scaffold


def test_names_derive_from_the_backend_name() -> None:
    names = scaffold.plugin_names("my_npu", order=650)
    assert names.distribution == "cardcage-my-npu"
    assert names.module == "cardcage_my_npu"
    assert names.class_name == "MyNpuAccelerator"
    assert names.switch == "MY_NPU"
    assert names.order == 650
    major, minor = cardcage.__version__.split(".")[:2]
    assert names.core_requirement == f"cardcage-core>={major}.{minor},<{major}.{int(minor) + 1}"


def test_it_writes_a_complete_distribution(tmp_path: Path) -> None:
    names, folder, files = scaffold.new_plugin("acme", tmp_path / "out", order=650)
    assert folder == tmp_path / "out"
    expected = ["pyproject.toml", "cardcage_acme.py", "README.md", "noxfile.py"]
    assert files == [*expected, "tests/test_acme.py", "tests/test_conformance.py"]
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == sorted(
        files
    )

    project = tomllib.loads((folder / "pyproject.toml").read_text())
    assert project["project"]["name"] == "cardcage-acme"
    assert project["project"]["dependencies"] == [names.core_requirement]
    assert project["project"]["entry-points"]["cardcage"] == {"acme": "cardcage_acme"}
    assert project["build-system"]["build-backend"] == "hatchling.build"
    assert project["tool"]["hatch"]["build"]["targets"]["wheel"]["only-include"] == [
        "cardcage_acme.py"
    ]

    module = (folder / "cardcage_acme.py").read_text()
    ast.parse(module)
    assert "class AcmeAccelerator(Accelerator):" in module
    assert 'NAME = "acme"' in module and 'SWITCH = "ACME"' in module
    assert "order=650," in module
    ast.parse((folder / "tests/test_acme.py").read_text())
    conformance = (folder / "tests/test_conformance.py").read_text()
    ast.parse(conformance)
    assert '"in_process": Launch({"distributed_backend": NAME})' in conformance
    ast.parse((folder / "noxfile.py").read_text())
    readme = (folder / "README.md").read_text()
    assert readme.startswith("# cardcage-acme\n")
    assert "**Rule 650 `acme`**" in readme
    for path in files:
        assert "$" not in (folder / path).read_text().replace("$ ", ""), path


def test_the_default_directory_is_named_after_the_distribution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _, folder, _ = scaffold.new_plugin("my_npu")
    assert folder == Path("cardcage-my-npu")
    assert (tmp_path / "cardcage-my-npu" / "cardcage_my_npu.py").is_file()


def test_an_empty_directory_is_filled(tmp_path: Path) -> None:
    scaffold.new_plugin("acme", tmp_path)
    assert (tmp_path / "pyproject.toml").is_file()


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("Acme", r"NAME='Acme' is not a backend name: use lower-case letters"),
        ("1acme", r"NAME='1acme' is not a backend name"),
        ("ac-me", r"NAME='ac-me' is not a backend name"),
        ("class", r"not a Python keyword"),
        ("a" * 25, r"at most 24 characters"),
        ("", r"NAME='' is not a backend name"),
        ("cardcage-acme", r"includes the prefix 'cardcage-'.*Use NAME='acme'"),
        ("cardcage_acme", r"includes the prefix 'cardcage_'.*Use NAME='acme'"),
        ("cpu", r"NAME='cpu' is taken by a backend that ships with cardcage"),
        ("ddp_spawn", r"NAME='ddp_spawn' is taken"),
        ("spawn", r"NAME='spawn' is taken"),
        ("core", r"NAME='core' is taken"),
    ],
)
def test_bad_names_are_refused(name: str, match: str, tmp_path: Path) -> None:
    with pytest.raises(MisconfigurationError, match=match):
        scaffold.new_plugin(name, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@functools.cache
def _plugin_install() -> Any:
    """tests/plugin_install.py, the helpers that pip-install throwaway plugin distributions
    (tests/conftest.py makes it importable for tests/ alone, so it is loaded by its path)."""
    path = Path(__file__).resolve().parents[3] / "tests" / "plugin_install.py"
    spec = importlib.util.spec_from_file_location("plugin_install", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_a_name_an_installed_plugin_has_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plugin distribution pip-installed into a folder put first on ``sys.path``."""
    helpers = _plugin_install()
    source = helpers.plugin_source(tmp_path / "src", "acme", "", distribution="cardcage-acme-npu")
    helpers.pip_install(tmp_path / "site", [source], "the acme plugin")
    scaffold.plugin_names("acme")  # not installed yet: accepted
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(
        MisconfigurationError,
        match=r"new-plugin NAME='acme' is already the name of an installed cardcage plugin "
        r"\(cardcage-acme-npu 0\.1\.0\)",
    ):
        scaffold.plugin_names("acme")


@pytest.mark.parametrize("order", [0, -5, True])
def test_bad_orders_are_refused(order: int) -> None:
    with pytest.raises(MisconfigurationError, match=r"--order=.* is not a rule order"):
        scaffold.plugin_names("acme", order)


def test_nothing_is_overwritten(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(MisconfigurationError, match=r"--directory=.* is not empty.*overwrites"):
        scaffold.new_plugin("acme", tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
    with pytest.raises(MisconfigurationError, match=r"--directory=.* is a file"):
        scaffold.new_plugin("acme", tmp_path / "keep.txt")


def test_the_command_writes_and_says_what_next(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "acme"
    assert cli.main(["new-plugin", "acme", "--directory", str(target), "--order", "650"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"created cardcage-acme in {target}: pyproject.toml, cardcage_acme.py")
    assert f"pip install -e {target}" in out
    assert "ACME=1 cardcage explain" in out
    assert "order=650," in (target / "cardcage_acme.py").read_text()


def test_the_command_exits_2_with_the_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(["new-plugin", "ddp"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cardcage: error: new-plugin NAME='ddp' is taken")
    assert list(tmp_path.iterdir()) == []

    assert cli.main(["new-plugin", "acme"]) == 0
    assert cli.main(["new-plugin", "acme"]) == 2
    err = capsys.readouterr().err
    assert "the directory 'cardcage-acme' (the default of --directory) already exists" in err


def test_distributed_writes_a_backend_of_one_rank_per_process(tmp_path: Path) -> None:
    _, folder, files = scaffold.new_plugin("acme", tmp_path / "out", distributed=True)
    module = (folder / "cardcage_acme.py").read_text()
    ast.parse(module)
    assert "class AcmeAccelerator(DistributedAccelerator):" in module
    assert "launcher = ScriptLauncher" in module
    assert "from cardcage.sdk import (" in module and "from cardcage." not in module.replace(
        "from cardcage.sdk", ""
    )
    conformance = (folder / "tests/test_conformance.py").read_text()
    assert '"num_processes": 2}, world_size=2)' in conformance
    assert "tests/test_acme.py" in files


def test_each_readme_describes_the_backend_its_module_is(tmp_path: Path) -> None:
    """Each scaffold's README says what its own module does: one process on the CPU, or one
    rank per process on one node or several, subclassing the SDK's DistributedAccelerator."""
    _, single, _ = scaffold.new_plugin("acme", tmp_path / "single")
    _, ranks, _ = scaffold.new_plugin("acme", tmp_path / "ranks", distributed=True)
    one = (single / "README.md").read_text()
    many = (ranks / "README.md").read_text()
    assert "trains in the calling process on the CPU" in one
    assert "`num_nodes > 1` it is an error" in one
    assert "`cardcage new-plugin acme --distributed`" in many
    assert "calling process" not in many and "is an error" not in many
    assert "one node or several" in many and "DistributedDataParallel" in many
    for readme in (one, many):
        assert "cardcage.backend.distributed" not in readme
        assert "`DistributedAccelerator`" in readme and "`cardcage.sdk`" in readme
