"""Every hook a plugin may implement is typed and documented, as in tox's spec.py.

The hook reference of the docs (reference/hooks.md) is generated from those docstrings.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import pluggy
import pytest

from cardcage.plugins import spec


def _hookspecs() -> dict[str, Callable[..., Any]]:
    return {
        name: function
        for name, function in vars(spec).items()
        if callable(function) and hasattr(function, f"{spec.NAME}_spec")
    }


HOOKS = _hookspecs()


def test_the_registration_hooks_exist() -> None:
    assert {"cardcage_accelerators", "cardcage_cluster_environments"} <= set(HOOKS)


def test_every_hook_function_of_the_module_is_a_hookspec() -> None:
    # A function named like a hook but not marked would silently never be called.
    hook_like = {name for name in vars(spec) if name.startswith("cardcage_")}
    assert hook_like == set(HOOKS)


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_hook_is_documented(name: str) -> None:
    doc = inspect.getdoc(HOOKS[name]) or ""
    summary = doc.splitlines()[0] if doc else ""
    assert summary.strip(), f"{name} has no docstring"
    assert ":return:" in doc or ":param" in doc, f"{name}'s docstring has no :param/:return:"
    documented = set(re.findall(r":param (\w+):", doc))
    parameters = set(inspect.signature(HOOKS[name]).parameters)
    assert documented == parameters, f"{name}: documented {documented}, takes {parameters}"
    if inspect.signature(HOOKS[name]).return_annotation not in ("None", None):
        assert ":return:" in doc, f"{name} returns a value but does not say what"


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_hook_is_typed(name: str) -> None:
    signature = inspect.signature(HOOKS[name])
    assert signature.return_annotation is not inspect.Signature.empty, f"{name}: no return type"
    for parameter in signature.parameters.values():
        assert parameter.annotation is not inspect.Parameter.empty, f"{name}({parameter.name})"


def test_the_spec_module_loads_into_pluggy() -> None:
    manager = pluggy.PluginManager(spec.NAME)
    manager.add_hookspecs(spec)
    assert set(HOOKS) <= {name for name in dir(manager.hook) if name.startswith("cardcage_")}
