"""``cardcage new-plugin acme`` writes a plugin that installs, loads, selects, trains and tests.

A module fixture runs the command in a temporary directory and installs the result with
``pip install --no-deps --target`` (as tests/test_third_party_plugin.py does); every check
then runs in a fresh process with that directory on ``PYTHONPATH``, so the test environment
itself is never modified.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import plugin_install
import pytest
from plugin_install import describe, pip_install, run, run_python

pytestmark = pytest.mark.slow

STEERING_PREFIXES = (*plugin_install.STEERING_PREFIXES, "ACME")
STEERING_NAMES = (*plugin_install.STEERING_NAMES, "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class Generated:
    root: Path  # where the command ran
    project: Path  # what it wrote
    site: Path  # where it was installed


def child_env(site: Path, **extra: str) -> dict[str, str]:
    """The parent's environment without anything that steers plugins or selection."""
    return plugin_install.child_env([site], STEERING_PREFIXES, STEERING_NAMES, **extra)


def generate(root: Path, *options: str) -> Generated:
    site = root / "site"
    result = run(["-m", "cardcage", "new-plugin", "acme", *options], root, child_env(site))
    project = root / "cardcage-acme"
    assert result.stdout.startswith("created cardcage-acme in cardcage-acme: pyproject.toml")
    pip_install(site, [project], "the generated plugin")
    info = site / "cardcage_acme-0.1.0.dist-info"
    assert "acme = cardcage_acme" in (info / "entry_points.txt").read_text()
    assert (site / "cardcage_acme.py").read_text() == (project / "cardcage_acme.py").read_text()
    return Generated(root, project, site)


@pytest.fixture(scope="module")
def acme(tmp_path_factory: pytest.TempPathFactory) -> Generated:
    return generate(tmp_path_factory.mktemp("new_plugin"))


@pytest.fixture(scope="module")
def acme_distributed(tmp_path_factory: pytest.TempPathFactory) -> Generated:
    return generate(tmp_path_factory.mktemp("new_plugin_distributed"), "--distributed")


def own_tests(generated: Generated) -> str:
    """Run the generated project's tests (the conformance kit's included); their summary."""
    result = run(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"],
        generated.project,
        child_env(generated.site),
        timeout=1200,
    )
    summary = result.stdout.strip().splitlines()[-1]
    assert "failed" not in summary and "error" not in summary, describe(result)
    return result.stdout


def cardcage_json(acme: Generated, *args: str, **env: str) -> Any:
    result = run(["-m", "cardcage", *args, "--json"], acme.root, child_env(acme.site, **env))
    return json.loads(result.stdout)


def test_cardcage_plugins_lists_it_with_its_distribution(acme: Generated) -> None:
    listing = cardcage_json(acme, "plugins")
    rows = {row["name"]: row for row in listing["backends"]}
    assert rows["acme"]["distribution"] == "cardcage-acme"
    assert rows["acme"]["version"] == "0.1.0"
    assert rows["acme"]["plugin"] == "acme"
    assert rows["acme"]["available"] is True
    assert rows["acme"]["rules"] == [{"order": 700, "name": "acme", "why": "ACME=1 is set"}]
    records = {record["name"]: record for record in listing["plugins"]}
    assert records["acme"]["status"] == "loaded"
    assert records["acme"]["module"] == "cardcage_acme"

    text = run(["-m", "cardcage", "plugins"], acme.root, child_env(acme.site)).stdout
    (line,) = [ln for ln in text.splitlines() if ln.strip().startswith("acme ")]
    assert "[cardcage-acme 0.1.0]  available: trains on the CPU" in line


def test_cardcage_explain_selects_it_by_name_and_by_its_rule(acme: Generated) -> None:
    named = cardcage_json(acme, "explain", "--distributed-backend", "acme")
    assert (named["accelerator"], named["rule"], named["requested"]) == (
        "acme",
        "distributed_backend",
        "acme",
    )

    ruled = cardcage_json(acme, "explain", ACME="1")
    assert (ruled["accelerator"], ruled["rule"], ruled["why"]) == ("acme", "acme", "ACME=1 is set")
    outcomes = [(e["accelerator"], e["order"], e["outcome"]) for e in ruled["trace"]]
    assert ("acme", 700, "claimed") in outcomes
    assert outcomes[-1] == ("cpu", 1000, "not evaluated")

    plain = cardcage_json(acme, "explain")
    assert plain["accelerator"] == "cpu"

    text = run(["-m", "cardcage", "explain"], acme.root, child_env(acme.site, ACME="1")).stdout
    assert text.splitlines()[0] == "selected 'acme' by acme: ACME=1 is set"


def test_its_own_tests_pass_unchanged_the_conformance_kit_included(acme: Generated) -> None:
    output = own_tests(acme)
    # 6 of its own, and the kit's (one launch, in this process: no failing rank to stop; no
    # sharded optimizer state or resume at another world size declared).
    assert "37 passed, 5 skipped" in output, output


def test_the_distributed_template_is_listed_selected_and_passes_the_kit(
    acme_distributed: Generated,
) -> None:
    listing = cardcage_json(acme_distributed, "plugins")
    rows = {row["name"]: row for row in listing["backends"]}
    assert (rows["acme"]["distribution"], rows["acme"]["available"]) == ("cardcage-acme", True)
    ruled = cardcage_json(acme_distributed, "explain", "--num-processes", "2", ACME="1")
    assert (ruled["accelerator"], ruled["rule"], ruled["world_size"]) == ("acme", "acme", 2)
    output = own_tests(acme_distributed)
    # 4 of its own and the kit's, with two processes started by script relaunch; the only
    # skips are the checks of what it does not declare (sharded optimizer state, resuming
    # at another world size).
    assert "38 passed, 2 skipped" in output, output
    assert "no other rank to stop" not in output, output


def test_the_kit_fails_a_suite_whose_launch_trains_another_backend(
    acme_distributed: Generated,
) -> None:
    """A suite for acme whose launch names ddp trains ddp, not acme: its training checks fail
    and say so, naming both, rather than pass on ddp's results."""
    suite = acme_distributed.project / "tests" / "test_conformance.py"
    original = suite.read_text()
    assert '{"distributed_backend": NAME, "num_processes": 2}' in original
    suite.write_text(
        original.replace('{"distributed_backend": NAME,', '{"distributed_backend": "ddp",')
    )
    try:
        command = ["-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite), "-k", "lifecycle"]
        env = child_env(acme_distributed.site)
        result = run_python(command, acme_distributed.project, env, timeout=600)
    finally:
        suite.write_text(original)
    assert result.returncode != 0, describe(result)
    assert "the suite tests 'acme' but its launch" in result.stdout, describe(result)
    assert "trained 'ddp'" in result.stdout, describe(result)


TRAIN = textwrap.dedent(
    """\
    import copy, json
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    import cardcage


    class Regressor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
            )

        def loss(self, batch):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def training_step(self, batch, batch_idx):
            return self.loss(batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


    x = torch.randn(96, 4, generator=torch.Generator().manual_seed(3))
    data = DataLoader(TensorDataset(x, (x[:, :1] - 2 * x[:, 1:2]).tanh()), batch_size=8)
    torch.manual_seed(0)
    model = Regressor()
    reference = copy.deepcopy(model)
    trainer = cardcage.Trainer(distributed_backend="acme", max_epochs=3, progress_bar=False)
    trainer.fit(model, data)

    optimizer = reference.configure_optimizers()
    losses = []
    for _ in range(3):
        for batch in data:
            optimizer.zero_grad()
            loss = reference.loss(batch)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    trained, expected = model.state_dict(), reference.state_dict()
    print(json.dumps({
        "accelerator": trainer.selection.accelerator,
        "class": type(trainer.accelerator).__module__ + "." + type(trainer.accelerator).__name__,
        "steps": trainer.global_step,
        "equal": all(torch.equal(trained[k], expected[k]) for k in expected),
        "losses_equal": trainer.losses == losses,
        "improved": losses[-1] < losses[0],
    }))
    """
)


def test_trainer_trains_through_it_like_a_plain_loop(acme: Generated) -> None:
    result = run(["-c", TRAIN], acme.root, child_env(acme.site))
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {
        "accelerator": "acme",
        "class": "cardcage_acme.AcmeAccelerator",
        "steps": 36,
        "equal": True,
        "losses_equal": True,
        "improved": True,
    }


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed")
def test_it_passes_ruff_with_its_own_settings(acme: Generated) -> None:
    env = child_env(acme.site)
    run(["-m", "ruff", "check", "--no-cache", "."], acme.project, env)
    run(["-m", "ruff", "format", "--no-cache", "--check", "."], acme.project, env)
