"""The plugin tutorial's backend (examples/plugin-tutorial) installs, tests and trains.

The tutorial page (docs/writing-a-plugin.md) shows the plugin's code through snippet
markers, so its text is the code; the first test checks that every snippet it includes
exists. The others install the plugin with ``pip install --no-deps --target``, run its own
tests, and train through it in two processes started the way ``jsrun`` starts them (its
variables and a rank file), against a plain PyTorch loop.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import plugin_install
import pytest
import torch
from plugin_install import describe, pip_install, run, run_python

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "examples" / "plugin-tutorial"
PAGE = ROOT / "docs" / "writing-a-plugin.md"
# pymdownx.snippets' block form (ruff format leaves it alone inside a python fence):
# a line --8<--, the files (path or path:section, relative to the repository root), --8<--.
SNIPPETS = re.compile(r"^--8<--\n(.*?)\n--8<--$", re.MULTILINE | re.DOTALL)

STEERING_PREFIXES = (*plugin_install.STEERING_PREFIXES, "LSB_", "JSM_")
STEERING_NAMES = (*plugin_install.STEERING_NAMES, "LOCAL_WORLD_SIZE")


def test_every_snippet_the_page_includes_exists() -> None:
    text = PAGE.read_text()
    found = [line for block in SNIPPETS.findall(text) for line in block.splitlines()]
    assert "--8<-- " not in text  # the one-line form, which ruff format would rewrite
    assert len(found) >= 4, found
    for reference in found:
        path, _, section = reference.partition(":")
        assert path.startswith("examples/plugin-tutorial/"), reference
        source = (ROOT / path).read_text()
        if section:
            start, end = f"# --8<-- [start:{section}]\n", f"# --8<-- [end:{section}]\n"
            assert source.count(start) == source.count(end) == 1, reference
            assert source.index(start) < source.index(end), reference
    sections = re.findall(r"# --8<-- \[start:(\w+)\]", (TUTORIAL / "cardcage_lsf.py").read_text())
    # every part of the module is on the page
    assert {f"examples/plugin-tutorial/cardcage_lsf.py:{s}" for s in sections} <= set(found)


def child_env(site: Path, **extra: str) -> dict[str, str]:
    return plugin_install.child_env([site], STEERING_PREFIXES, STEERING_NAMES, **extra)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tutorial's plugin, installed into a directory of its own."""
    target = tmp_path_factory.mktemp("plugin_tutorial") / "site"
    pip_install(target, [TUTORIAL], "the tutorial's plugin")
    return target


@pytest.mark.slow
def test_cardcage_lists_it_and_refuses_it_outside_jsrun(site: Path) -> None:
    listing = json.loads(
        run(["-m", "cardcage", "plugins", "--json"], site.parent, child_env(site)).stdout
    )
    rows = {row["name"]: row for row in listing["backends"]}
    assert rows["lsf"]["distribution"] == "cardcage-lsf"
    assert rows["lsf"]["aliases"] == ["jsrun"]
    assert rows["lsf"]["available"] is False
    assert "not started by jsrun" in rows["lsf"]["reason"]
    result = run_python(
        ["-m", "cardcage", "explain", "--backend", "jsrun"], site.parent, child_env(site), 120
    )
    assert result.returncode == 2, describe(result)
    assert "launch the script with jsrun inside an LSF job" in result.stderr


@pytest.mark.slow
def test_its_own_tests_pass(site: Path) -> None:
    result = run(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider"], TUTORIAL, child_env(site), timeout=1200
    )
    # 7 of its own and the conformance kit's, two jsrun ranks included.
    assert "41 passed" in result.stdout and "failed" not in result.stdout, describe(result)


RANK = textwrap.dedent(
    """\
    import json, sys
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    import cardcage


    class Regressor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
            )

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)


    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(3))
    data = DataLoader(TensorDataset(x, (x[:, :1] - 2 * x[:, 1:2]).tanh()), batch_size=8)
    torch.manual_seed(int(sys.argv[2]))  # DDP starts every rank from rank 0's weights
    model = Regressor()
    trainer = cardcage.Trainer(max_epochs=2, progress_bar=False)  # no backend named
    trainer.fit(model, data)
    selection = trainer.selection
    with open(sys.argv[1], "w") as out:
        json.dump({
            "selection": [selection.accelerator, selection.rule, selection.cluster,
                          selection.world_size, selection.global_rank, selection.node_rank],
            "backend": type(trainer.accelerator).__name__,
            "steps": trainer.global_step,
            "weights": {k: v.tolist() for k, v in model.state_dict().items()},
        }, out)
    """
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def plain_loop() -> dict[str, torch.Tensor]:
    """Rank 0's initial weights, trained on whole batches of 16: the two ranks' shards of
    8 (even and odd samples) with their gradients averaged."""
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(3))
    y = (x[:, :1] - 2 * x[:, 1:2]).tanh()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    for _ in range(2):
        for start in range(0, 64, 16):
            optimizer.zero_grad()
            batch = slice(start, start + 16)
            torch.nn.functional.mse_loss(net(x[batch]), y[batch]).backward()
            optimizer.step()
    return {f"net.{key}": value for key, value in net.state_dict().items()}


@pytest.mark.slow
def test_two_jsrun_ranks_train_like_a_plain_loop(site: Path) -> None:
    work = site.parent
    host = socket.gethostname().split(".")[0]
    (work / "rankfile").write_text(f"launch01\n{host}\n{host}\n")
    (work / "rank.py").write_text(RANK)
    job = {
        "LSB_JOBID": "4242",
        "LSB_DJOB_RANKFILE": str(work / "rankfile"),
        "JSM_NAMESPACE_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "CARDCAGE_INIT_TIMEOUT": "120",
        "CARDCAGE_PLUGINS_AUTOLOAD": "0",  # the tutorial's plugin alone
        "CARDCAGE_PLUGINS": "lsf",
        "OMP_NUM_THREADS": "1",
    }
    ranks = [
        subprocess.Popen(
            [sys.executable, "rank.py", f"rank{rank}.json", str(rank)],
            cwd=work,
            env=child_env(
                site, **job, JSM_NAMESPACE_RANK=str(rank), JSM_NAMESPACE_LOCAL_RANK=str(rank)
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = []
    try:
        for process in ranks:
            out, err = process.communicate(timeout=240)
            outputs.append(f"exit {process.returncode}\n{out}\n{err}")
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert all(process.returncode == 0 for process in ranks), "\n".join(outputs)

    reports: list[dict[str, Any]] = [
        json.loads((work / f"rank{rank}.json").read_text()) for rank in range(2)
    ]
    for rank, report in enumerate(reports):
        assert report["selection"] == ["lsf", "jsrun", "lsf", 2, rank, 0]
        assert report["backend"] == "LSFAccelerator"
        assert report["steps"] == 2 * 4  # 8 batches of 8, half of them on each rank
    expected = plain_loop()
    for report in reports:
        assert report["weights"].keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(torch.tensor(report["weights"][key]), value)
