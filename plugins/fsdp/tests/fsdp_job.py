"""fsdp training jobs for tests/test_fsdp.py: ``python fsdp_job.py SCENARIO OUT [PROCESSES]``.

They use fsdp alone (``nox -s fsdp`` installs no other backend); the reference is a plain
PyTorch loop.

Every process that runs it (the caller, and under script relaunch every rank) runs the
scenario; rank 0 writes ``OUT/<scenario>.json``. The model has two children and a
parameter of its own (the root's share), trained with Adam on unshuffled data at a global
batch of 16 (8 per process with two).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

import cardcage

GLOBAL_BATCH = 16
SAMPLES = 96


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 32)
        self.b = torch.nn.Linear(32, 2)
        self.scale = torch.nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) * self.scale

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.02)


def data(processes: int) -> torch.utils.data.DataLoader[Any]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(SAMPLES, 6, generator=g)
    y = torch.randn(SAMPLES, 2, generator=g)
    dataset = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(dataset, batch_size=GLOBAL_BATCH // processes)


def net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def fit(model: Net, processes: int, **flags: Any) -> cardcage.Trainer:
    trainer = cardcage.Trainer(
        distributed_backend="fsdp",
        num_processes=processes,
        max_epochs=2,
        progress_bar=False,
        **flags,
    )
    trainer.fit(model, data(processes))
    return trainer


def weights(model: torch.nn.Module) -> list[float]:
    return [float(v) for p in model.parameters() for v in p.detach().reshape(-1)]


def main(scenario: str, out: Path, processes: int) -> dict[str, Any]:
    folder = out / "sharded.ckpt"
    if scenario == "sharded":  # train, save sharded mid-run, resume on the same ranks
        straight = net()
        trainer = fit(straight, processes, max_steps=10)
        os.environ["CARDCAGE_FSDP_STATE_DICT"] = "sharded"
        first = fit(net(), processes, max_steps=4)
        first.save_checkpoint(folder)
        full = out / "full.ckpt"
        os.environ["CARDCAGE_FSDP_STATE_DICT"] = "full"  # read when a Trainer is made
        fit(net(), processes, max_steps=4).save_checkpoint(full)
        resumed = net(seed=7)
        fit(resumed, processes, max_steps=10, resume_from_checkpoint=str(folder))
        from_full = net(seed=8)
        fit(from_full, processes, max_steps=10, resume_from_checkpoint=str(full))
        state = torch.load(full, weights_only=True)
        return {
            "class": type(straight).__name__,
            "plain": all(type(p) is torch.nn.Parameter for p in straight.parameters()),
            "local_shapes": {  # what this rank holds between steps
                name: list(p.to_local().shape)
                for name, p in trainer.accelerator.sharded.named_parameters()
            },
            "full_shapes": {k: list(v.shape) for k, v in state["state_dict"].items()},
            "adam_steps": [float(s["step"]) for s in state["optimizers"][0]["state"].values()],
            "weights": weights(straight),
            "resumed": weights(resumed),
            "resumed_from_full": weights(from_full),
            "shards": sorted(p.name for p in folder.iterdir()),
        }
    if scenario == "resume_alone":  # the 2-rank sharded checkpoint, on one rank
        resumed = net(seed=9)
        fit(resumed, 1, max_steps=10, resume_from_checkpoint=str(folder))
        return {"resumed": weights(resumed)}
    if scenario == "reference":  # a plain PyTorch loop over the whole batch
        model = net()
        optimizer = model.configure_optimizers()
        batches = [batch for _ in range(2) for batch in data(1)][:10]
        for batch_idx, batch in enumerate(batches):
            optimizer.zero_grad()
            model.training_step(batch, batch_idx).backward()
            optimizer.step()
        return {"weights": weights(model)}
    if scenario == "bf16":
        model, full = net(), net()
        trainer = fit(model, processes, max_steps=10, precision="bf16")
        fit(full, processes, max_steps=10)
        return {
            "losses": trainer.losses,
            "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "weights": weights(model),
            "fp32": weights(full),
        }
    if scenario == "save_alone":  # one process: save after fit, once its group is gone
        resumed_from = {}
        for state_dict in ("full", "sharded"):
            os.environ["CARDCAGE_FSDP_STATE_DICT"] = state_dict  # read when a Trainer is made
            path = out / f"alone-{state_dict}.ckpt"
            fit(net(), 1, max_steps=4).save_checkpoint(path)
            resumed = net(seed=11)
            fit(resumed, 1, max_steps=10, resume_from_checkpoint=str(path))
            resumed_from[state_dict] = weights(resumed)
        return resumed_from
    raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    name, folder = sys.argv[1], Path(sys.argv[2])
    result = main(name, folder, int(sys.argv[3]) if len(sys.argv) > 3 else 2)
    if int(os.environ.get("RANK", "0")) == 0:
        (folder / f"{name}.json").write_text(json.dumps(result))
