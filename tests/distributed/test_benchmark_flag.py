"""``benchmark=True`` reaches every training process: the spawned workers of ``ddp_spawn``
(a real two-process fit with gloo on the CPU) train with ``torch.backends.cudnn.benchmark``
on, and the calling process has its own value back after the fit.

The job is a script of its own (its model is carried to the workers by value), run as a
user runs it.
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

import pytest

from .conftest import PYTHON

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import cardcage

    OUT = Path(sys.argv[1])


    class Recorder(torch.nn.Module):
        # training_step writes the cudnn flag its process trains with
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            seen = {"pid": os.getpid(), "benchmark": torch.backends.cudnn.benchmark}
            (OUT / f"rank{os.environ['RANK']}.json").write_text(json.dumps(seen))
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    if __name__ == "__main__":
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
        data = DataLoader(TensorDataset(x, x[:, :1]), batch_size=2)
        before = torch.backends.cudnn.benchmark
        trainer = cardcage.Trainer(
            distributed_backend="ddp_spawn",
            num_processes=2,
            benchmark=True,
            max_steps=1,
            progress_bar=False,
        )
        trainer.fit(Recorder(), data)
        caller = {"pid": os.getpid(), "before": before, "after": torch.backends.cudnn.benchmark}
        (OUT / "caller.json").write_text(json.dumps(caller))
    """
)


def test_ddp_spawn_workers_train_with_benchmark_and_the_caller_keeps_its_value(
    harness: Any,
) -> None:
    out = harness.root / "out"
    out.mkdir()
    script = harness.root / "benchmark_job.py"
    script.write_text(SCRIPT)
    harness.start([PYTHON, str(script), str(out)], name="benchmark_job.py").check()
    harness.assert_no_leftovers()
    caller = json.loads((out / "caller.json").read_text())
    ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(ranks) == [0, 1]
    assert all(rank["pid"] != caller["pid"] for rank in ranks.values())  # workers trained
    assert {r: seen["benchmark"] for r, seen in ranks.items()} == {0: True, 1: True}
    assert (caller["before"], caller["after"]) == (False, False)
