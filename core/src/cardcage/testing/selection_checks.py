"""The suite's checks of loading and selection: nothing here starts a training process."""

from __future__ import annotations

import inspect
import json
from typing import Any

import pytest

import cardcage
from cardcage.testing.suite import ENVIRONMENTS, SuiteBase

# Runs in a fresh interpreter: loads the plugin alone, strictly, and prints what it found.
LOAD_ALONE = """
import json, sys
from cardcage.plugins import manager as plugins
registry = plugins.registry(__import__("os").environ)
found = registry.accelerators.get(sys.argv[1])
print(json.dumps({
    "names": sorted(registry.accelerators),
    "plugin": found.plugin if found else None,
    "distribution": found.distribution if found else None,
    "records": [[r.name, r.status, r.error or ""] for r in registry.plugins],
}))
"""

# Selects with every way to start a process, a thread or a socket watched, and reports what
# was started (closed again or not) and whether a CUDA context exists.
PURITY = """
import json, os, socket, subprocess, sys, threading
import torch, cardcage
from cardcage.plugins import manager as plugins
plugins.registry(os.environ)
started = {"children": [], "threads": [], "sockets": []}
def watch(owner, method, kind):
    original = getattr(owner, method)
    def watched(self, *args, **kwargs):
        started[kind].append(repr(args[:1]) if kind == "children" else type(self).__name__)
        return original(self, *args, **kwargs)
    setattr(owner, method, watched)
watch(subprocess.Popen, "__init__", "children")
watch(threading.Thread, "start", "threads")
watch(socket.socket, "__init__", "sockets")
import _posixsubprocess
for module, name in ((os, "fork"), (os, "posix_spawn"), (_posixsubprocess, "fork_exec")):
    def starting(*args, _original=getattr(module, name), _name=name, **kwargs):
        started["children"].append(_name)
        return _original(*args, **kwargs)
    setattr(module, name, starting)
for flags in ({"distributed_backend": sys.argv[1]}, {}, {"num_processes": 2}):
    try:
        cardcage.select(**flags).explain()
    except cardcage.MisconfigurationError:
        pass
print(json.dumps({"started": started, "cuda": torch.cuda.is_initialized()}))
"""


class SelectionChecks(SuiteBase):
    """Loading, names, purity of selection, and the rule matrix."""

    def alone(self) -> dict[str, str]:
        return {"CARDCAGE_PLUGINS_AUTOLOAD": "0", "CARDCAGE_PLUGINS": self.entry_point()}

    def test_loads_alone_and_strict(self) -> None:
        result = self._run(LOAD_ALONE, self.backend, CARDCAGE_STRICT_PLUGINS="1")
        assert result.returncode == 0, result.stderr
        found = json.loads(result.stdout)
        assert found["plugin"] == self.entry_point(), found
        assert found["distribution"], f"{self.backend} is registered by no distribution: {found}"

    def test_names_and_aliases_are_its_own(self) -> None:
        """With every installed plugin loaded strictly, its names all lead to it."""
        from cardcage.plugins import manager as plugins

        result = self._run(LOAD_ALONE, self.backend, CARDCAGE_STRICT_PLUGINS="1", alone=False)
        assert result.returncode == 0, f"loading every plugin strictly failed:\n{result.stderr}"
        registry = plugins.registry({"CARDCAGE_PLUGINS_AUTOLOAD": "1"})
        cls = registry.accelerators[self.backend].cls
        for name in cls.names():
            assert registry.canonical(name) == self.backend, (name, registry.canonical(name))

    def test_select_and_availability_are_pure(self) -> None:
        result = self._run(PURITY, self.backend)
        assert result.returncode == 0, result.stderr
        seen = json.loads(result.stdout)
        started = seen["started"]
        assert not started["children"], f"select started a process: {started['children']}"
        assert not started["threads"], f"select started a thread: {started['threads']}"
        assert not started["sockets"], f"select opened a socket: {started['sockets']}"
        assert not seen["cuda"], "select created a CUDA context"

    @pytest.mark.parametrize("environment", sorted(ENVIRONMENTS))
    def test_rule_matrix(self, environment: str) -> None:
        """Named or not, in each environment: a Selection (JSON-safe, explained with this
        backend's rules) with the rank, world size and rule the environment and flags call
        for, or a MisconfigurationError that names a flag or variable, nothing else."""
        import cardcage
        from cardcage.plugins import manager as plugins
        from cardcage.selection.rules import rule_name

        env = {**self.alone(), **ENVIRONMENTS[environment]}
        registry = plugins.registry(env)
        cls = registry.accelerators[self.backend].cls
        for flags in ({"distributed_backend": self.backend}, {}, {"num_nodes": 2}):
            where = f"{flags} in {environment}"
            try:
                selection = cardcage.select(env=env, **flags)
            except cardcage.MisconfigurationError as error:
                named = [*FLAGS, *ENVIRONMENTS[environment], "MASTER_ADDR", "MASTER_PORT"]
                assert any(name in str(error) for name in named), (
                    f"{where}: the error names none of {named}: {error}"
                )
                continue
            json.dumps(selection.as_dict())
            text = selection.explain()
            for rule in cls.rules:
                name = rule_name(rule, cls)
                assert name in text, f"{where}: explain() does not list rule {name}: {text}"
            chosen = registry.accelerators.get(selection.accelerator)
            assert chosen is not None, f"{where}: {selection.accelerator!r} is not installed"
            if "distributed_backend" in flags:
                ours = chosen.plugin == registry.accelerators[self.backend].plugin
                assert ours and selection.rule == "distributed_backend", (
                    f"{where}: {self.backend!r} was named, but rule {selection.rule!r} chose "
                    f"{selection.accelerator!r}"
                )
            else:
                rules = {rule_name(rule, chosen.cls) for rule in chosen.cls.rules}
                assert selection.rule in rules, (
                    f"{where}: rule {selection.rule!r} is none of {selection.accelerator!r}'s "
                    f"{sorted(rules)}"
                )
            expected = _expected_place(environment, selection)
            found = (selection.global_rank, selection.world_size, selection.node_rank)
            assert found == expected, (
                f"{where}: (rank, world size, node rank) {found}, expected {expected} "
                f"({selection.cluster}): {selection.as_dict()}"
            )

    def _run(self, code: str, argument: str, alone: bool = True, **env: str) -> Any:
        import os
        import subprocess
        import sys

        extra = {**(self.alone() if alone else {}), **env}
        return subprocess.run(
            [sys.executable, "-c", code, argument],
            env={**os.environ, **extra},
            capture_output=True,
            text=True,
            timeout=300,
        )


#: What an error may name for the user to change: a Trainer flag or a launcher's variable.
FLAGS = tuple(
    name
    for name, parameter in inspect.signature(cardcage.Trainer).parameters.items()
    if parameter.kind is parameter.KEYWORD_ONLY or parameter.kind is parameter.POSITIONAL_OR_KEYWORD
)

#: The launcher each fake environment stands for, and the rank of 2 it gives this process.
LAUNCHERS = {"torchrun_rank1": "torchelastic", "slurm": "slurm", "horovodrun": "horovod"}


def _expected_place(environment: str, selection: Any) -> tuple[int, int, int]:
    """(global rank, world size, node rank) that ``environment`` calls for: rank 1 of 2 where
    its launcher started the processes (torchrun and horovodrun always do; SLURM where its
    task count is the job's), otherwise this node's first rank of num_nodes x per-node
    processes (node 1 under ``NODE_RANK=1``)."""
    launcher = LAUNCHERS.get(environment)
    if launcher is not None and (environment != "slurm" or selection.cluster == "slurm"):
        assert selection.cluster == launcher and selection.processes_created_outside, (
            f"{launcher} started these processes, but the selection's cluster is "
            f"{selection.cluster!r}: {selection.as_dict()}"
        )
        return (1, 2, selection.node_rank)
    node = 1 if environment == "two_nodes" else 0
    per_node = selection.num_processes
    return (node * per_node, selection.num_nodes * per_node, node)
