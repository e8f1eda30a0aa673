"""``trainer.predict`` in a real job: ``python predict_job.py OUT MODE SCENARIO...``.

``MODE`` picks the flags: ``torchrun`` (``distributed_backend="ddp"`` in processes torchrun
started), ``relaunch`` (``ddp`` with ``num_processes=2``: the first fit relaunches this
script as rank 1) or ``spawn`` (``ddp_spawn`` with ``num_processes=2``: the caller predicts
after fit). Every process that runs the scenarios writes ``OUT/<scenario>-rank<R>.json``:
``got`` (what ``trainer.predict`` returned) and ``expected`` (a plain loop over the whole
loader in this process, with the same weights), as JSON, and ``seen`` (the samples
``predict_step`` got in this process: its shard).

The model is elementwise (``x * w + b``), so a sample's prediction is bit-identical whatever
batch it is computed in, and ``predict_step`` multiplies by the sample's index, so a sample
put back in the wrong place changes the result.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage

SAMPLES, BATCH = 7, 2  # 7 over 2 ranks: one padded sample; batches of 2: a short last one


def dataset(samples: int = SAMPLES) -> TensorDataset:
    x = torch.arange(samples * 3, dtype=torch.float64).reshape(samples, 3) / 7 - 1
    return TensorDataset(x, torch.arange(samples))


def loader(samples: int = SAMPLES, batch: int = BATCH, **options: Any) -> DataLoader[Any]:
    return DataLoader(dataset(samples), batch_size=batch, **options)


class Net(torch.nn.Module):
    """Elementwise, trainable; ``kind`` picks what ``predict_step`` returns."""

    def __init__(self, kind: str = "tensor") -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        self.w = torch.nn.Parameter(torch.randn(3, dtype=torch.float64, generator=generator))
        self.b = torch.nn.Parameter(torch.randn(3, dtype=torch.float64, generator=generator))
        self.kind = kind
        self.seen: list[int] = []  # the samples predict_step got in this process

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = x * self.w + self.b
        return y

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        loss: torch.Tensor = self(x).pow(2).mean()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        x, index = batch
        self.seen.extend(int(i) for i in index)
        y = self(x) * (index[:, None] + 1) + 100 * dataloader_idx
        if self.kind == "dict":
            return {"y": y, "pair": (index * 2, y.sum(1))}
        if self.kind == "strings":
            return [f"sample {int(i)}" for i in index]
        return y


class Forward(torch.nn.Module):
    """No ``predict_step``: ``trainer.predict`` calls the model."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(3, dtype=torch.float64) - 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def plain(value: Any) -> Any:
    """``value`` as JSON: tensors as ``{"tensor": values, "shape": shape}``."""
    if isinstance(value, torch.Tensor):
        return {"tensor": value.tolist(), "shape": list(value.shape), "dtype": str(value.dtype)}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def reference(model: torch.nn.Module, loaders: list[Any]) -> list[list[Any]]:
    """One process's predictions: a plain loop over each whole loader."""
    step = getattr(model, "predict_step", None)
    with torch.no_grad():
        return [
            [
                step(b, i, *([k] if len(loaders) > 1 else [])) if step else model(b)
                for i, b in enumerate(each)
            ]
            for k, each in enumerate(loaders)
        ]


FLAGS: dict[str, dict[str, Any]] = {
    "torchrun": {"distributed_backend": "ddp"},
    "relaunch": {"distributed_backend": "ddp", "num_processes": 2},
    "spawn": {"distributed_backend": "ddp_spawn", "num_processes": 2},
}


def run(mode: str, scenario: str) -> dict[str, Any]:
    flags: dict[str, Any] = {"progress_bar": False, **FLAGS[mode]}
    if scenario == "after_fit":  # a fit first: predict with its trained weights
        model = Net()
        trainer = cardcage.Trainer(max_epochs=1, **flags)
        trainer.fit(model, loader(8, 2))
        return compare(trainer, model, [loader()])
    if scenario == "tensor":
        return compare(cardcage.Trainer(**flags), Net(), [loader()])
    if scenario == "dict":
        return compare(cardcage.Trainer(**flags), Net("dict"), [loader()])
    if scenario == "two_loaders":  # the second: batches of 3, its short last one dropped
        loaders = [loader(), loader(8, 3, drop_last=True)]
        return compare(cardcage.Trainer(**flags), Net(), loaders)
    if scenario == "forward":
        data: Any = torch.arange(SAMPLES * 3, dtype=torch.float64).reshape(SAMPLES, 3)
        plain_loader: DataLoader[Any] = DataLoader(data, batch_size=BATCH)
        return compare(cardcage.Trainer(**flags), Forward(), [plain_loader])
    if scenario == "own_loader":  # replace_sampler_ddp=False: each rank predicts all of it
        trainer = cardcage.Trainer(replace_sampler_ddp=False, **flags)
        return compare(trainer, Net(), [loader()])
    if scenario == "shuffled":  # the sample each prediction is of: pair[0] // 2
        outputs = cardcage.Trainer(**flags).predict(Net("dict"), loader(shuffle=True))
        return {"indices": [int(i) // 2 for o in outputs for i in o["pair"][0]]}
    if scenario == "refused":
        try:
            cardcage.Trainer(**flags).predict(Net("strings"), loader())
        except cardcage.MisconfigurationError as error:
            return {"refused": str(error)}
        return {"refused": None}
    raise ValueError(scenario)


def compare(
    trainer: cardcage.Trainer, model: torch.nn.Module, loaders: list[Any]
) -> dict[str, Any]:
    model.train()
    got = trainer.predict(model, loaders if len(loaders) > 1 else loaders[0])
    seen = list(getattr(model, "seen", []))
    expected = reference(model, loaders)
    return {
        "seen": seen,
        "got": plain(got),
        "expected": plain(expected if len(loaders) > 1 else expected[0]),
        "training_after": model.training,
    }


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def main(argv: list[str]) -> int:
    out, mode, scenarios = Path(argv[0]), argv[1], argv[2:]
    out.mkdir(parents=True, exist_ok=True)
    for scenario in scenarios:
        result = run(mode, scenario)
        result["world_size"] = int(os.environ.get("WORLD_SIZE", "1"))
        path = out / f"{scenario}-rank{rank()}.json"
        path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
