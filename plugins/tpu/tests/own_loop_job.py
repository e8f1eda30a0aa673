"""A tpu own-loop job for test_own_loop.py: ``python own_loop_job.py OUT``, with
``PJRT_DEVICE=CPU`` and ``CPU_NUM_DEVICES=2``.

``cardcage.Cage(tpu_cores=8)`` launches :func:`train` in a replica per XLA device (two
threads of the process ``xmp.spawn`` starts). Each trains, with momentum SGD:

- ``parity``: batches of 8 per replica, one optimizer step per batch;
- ``accumulate``: batches of 4 per replica, two micro-batches per step, the first inside
  ``cage.no_backward_sync``;
- ``accumulate_plain``: the same without ``no_backward_sync`` (two backward passes, then the
  step: the gradients add up over two programs all the same);
- ``two``: two modules, each set up with its own optimizer, the loss of their sum;
- ``clip``: ``cage.clip_gradients(max_norm=0.5)`` before each step, the norm it returns
  read at once (``.item()``) and the weights read after each step, as a user's loop may;
- ``resume``: Adam for one epoch, ``cage.save``, other weights ``cage.load`` the file and
  train one more epoch;

then ``cage.all_gather`` of ``[rank + 1, 10 * (rank + 1)]``, and rank 0's weights come back
through ``launch``. :func:`plain` then trains the same in this process on the CPU with
batches of 16 (``accumulate``: two micro-batches of 8, each loss halved), for the test to
compare: after XLA's runtime started here, as a CPU backward before it would break XLA's.
OUT holds ``returned.json``, ``plain.json`` and ``checkpoint.json`` (what
``torch.load(weights_only=True)`` found in the saved file).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage

SAMPLES, EPOCHS, LR, MOMENTUM, CLIP = 64, 2, 0.1, 0.9, 0.5
SCENARIOS = ("parity", "accumulate", "accumulate_plain", "two", "clip", "resume")


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 4, generator=generator)
    return TensorDataset(x, x[:, :1] * 0.5 - x[:, 1:2] + 0.1)


def net(seed: int) -> torch.nn.Module:
    """Weights from a generator of their own: replicas are threads sharing torch's."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return model


def rank_net(cage: cardcage.Cage, seed: int) -> torch.nn.Module:
    """The plain loop's weights on rank 0, others elsewhere: setup gives every rank rank 0's."""
    return net(seed + 100 * cage.global_rank)


def sgd(module: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)


def adam(module: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(module.parameters(), lr=0.01)


def weights(*modules: torch.nn.Module) -> list[list[float]]:
    return [p.detach().cpu().reshape(-1).tolist() for m in modules for p in m.parameters()]


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, y)


def plain() -> dict[str, Any]:
    """The scenarios in one process on the CPU without cardcage: batches of 16."""
    results: dict[str, Any] = {}
    for name, make in (("parity", sgd), ("resume", adam)):
        model = net(0)
        optimizer = make(model)
        for _ in range(EPOCHS):
            for x, y in DataLoader(data(), batch_size=16):
                optimizer.zero_grad()
                mse(model(x), y).backward()
                optimizer.step()
        results[name] = weights(model)
    model = net(0)
    optimizer = sgd(model)
    for _ in range(EPOCHS):
        for i, (x, y) in enumerate(DataLoader(data(), batch_size=8)):
            if i % 2 == 0:
                optimizer.zero_grad()
            (mse(model(x), y) / 2).backward()
            if i % 2 == 1:
                optimizer.step()
    results["accumulate"] = results["accumulate_plain"] = weights(model)
    first, second = net(0), net(1)
    optimizers = [sgd(first), sgd(second)]
    for _ in range(EPOCHS):
        for x, y in DataLoader(data(), batch_size=16):
            for optimizer in optimizers:
                optimizer.zero_grad()
            mse(first(x) + second(x), y).backward()
            for optimizer in optimizers:
                optimizer.step()
    results["two"] = weights(first, second)
    model = net(0)
    optimizer = sgd(model)
    norms = []
    for _ in range(EPOCHS):
        for x, y in DataLoader(data(), batch_size=16):
            optimizer.zero_grad()
            mse(model(x), y).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            optimizer.step()
    results["clip"] = [*weights(model), norms]
    return results


def train(cage: cardcage.Cage, out: str) -> dict[str, Any]:
    results: dict[str, Any] = {"world_size": cage.world_size}

    model = rank_net(cage, 0)
    model, optimizer = cage.setup(model, sgd(model))
    loader = cage.setup_dataloaders(DataLoader(data(), batch_size=8))
    for _ in range(EPOCHS):
        for x, y in loader:
            optimizer.zero_grad()
            cage.backward(mse(model(x), y))
            optimizer.step()
    results["parity"] = weights(model)

    for name, hold in (("accumulate", True), ("accumulate_plain", False)):
        model = rank_net(cage, 0)
        model, optimizer = cage.setup(model, sgd(model))
        loader = cage.setup_dataloaders(DataLoader(data(), batch_size=4))
        for _ in range(EPOCHS):
            for i, (x, y) in enumerate(loader):
                if i % 2 == 0:
                    optimizer.zero_grad()
                with cage.no_backward_sync(model, enabled=hold and i % 2 == 0):
                    cage.backward(mse(model(x), y) / 2)
                if i % 2 == 1:
                    optimizer.step()
        results[name] = weights(model)

    first, second = rank_net(cage, 0), rank_net(cage, 1)
    first, first_optimizer = cage.setup(first, sgd(first))
    second, second_optimizer = cage.setup(second, sgd(second))
    loader = cage.setup_dataloaders(DataLoader(data(), batch_size=8))
    for _ in range(EPOCHS):
        for x, y in loader:
            first_optimizer.zero_grad()
            second_optimizer.zero_grad()
            cage.backward(mse(first(x) + second(x), y))
            first_optimizer.step()
            second_optimizer.step()
    results["two"] = weights(first, second)

    model = rank_net(cage, 0)
    model, optimizer = cage.setup(model, sgd(model))
    loader = cage.setup_dataloaders(DataLoader(data(), batch_size=8))
    norms = []
    for _ in range(EPOCHS):
        for x, y in loader:
            optimizer.zero_grad()
            cage.backward(mse(model(x), y))
            norm = cage.clip_gradients(model, optimizer, max_norm=CLIP)
            norms.append(norm.item())  # read at once, as a user logs it
            optimizer.step()
            weights(model)  # the weights read before the next batch
    results["clip"] = [*weights(model), norms]

    path = str(Path(out, "resume.ckpt"))
    model = rank_net(cage, 0)
    model, optimizer = cage.setup(model, adam(model))
    loader = cage.setup_dataloaders(DataLoader(data(), batch_size=8))
    for epoch in range(EPOCHS):
        if epoch == 1:
            cage.save(path, {"model": model, "optimizer": optimizer, "epoch": epoch})
            model = rank_net(cage, 3)
            model, optimizer = cage.setup(model, adam(model))
            rest = cage.load(path, {"model": model, "optimizer": optimizer})
            results["rest"] = rest
        for x, y in loader:
            optimizer.zero_grad()
            cage.backward(mse(model(x), y))
            optimizer.step()
    results["resume"] = weights(model)

    rank = float(cage.global_rank + 1)
    gathered = cage.all_gather(torch.tensor([rank, 10 * rank], device=cage.device))
    results["gathered"] = gathered.cpu().tolist()
    results["reduced"] = cage.all_reduce(torch.tensor([rank], device=cage.device)).cpu().tolist()
    return results


def main(out: Path) -> None:
    cage = cardcage.Cage(tpu_cores=8)
    returned = cage.launch(train, str(out))
    (out / "returned.json").write_text(json.dumps(returned))
    saved = torch.load(out / "resume.ckpt", weights_only=True)
    summary = {
        key: sorted(value) if isinstance(value, dict) else value for key, value in saved.items()
    }
    summary["devices"] = sorted({str(t.device) for t in saved["model"].values()})
    (out / "checkpoint.json").write_text(json.dumps(summary, default=str))
    (out / "plain.json").write_text(json.dumps(plain()))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
