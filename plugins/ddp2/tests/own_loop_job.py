"""A ddp2 own-loop job for test_own_loop.py: ``python own_loop_job.py OUT``, started once
per node (``NODE_RANK`` 0 and 1, ``MASTER_ADDR``/``MASTER_PORT`` set by the test).

``cardcage.Cage(distributed_backend="ddp2", num_nodes=2)`` with no GPU trains one CPU
process per node: ``launch`` runs :func:`train` in place in each. Each trains, with momentum
SGD:

- ``parity``: batches of 8 per rank, one optimizer step per batch;
- ``accumulate``: batches of 4 per rank, two micro-batches per step, the first inside
  ``cage.no_backward_sync``; after each backward it records whether the gradients equal
  their mean over the ranks (one all-reduce of a copy);
- ``two``: two modules, each set up with its own optimizer (two ``cage.setup`` calls), the
  loss of their sum;

and rank 0's weights come back through ``launch`` in both. Each rank builds its modules from
a seed of its own (rank 0 from the plain loop's): ``setup`` gives every rank rank 0's
weights. :func:`plain` trains the same in one process with batches of 16 (``accumulate``:
two micro-batches of 8, each loss halved), for the test to compare. OUT/rank<R>.json holds
what each rank saw, OUT/returned<R>.json what its ``launch`` returned, OUT/plain.json the
plain loop's weights (node 0 writes it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage

SAMPLES, EPOCHS, LR, MOMENTUM = 64, 2, 0.1, 0.9


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 4, generator=generator)
    return TensorDataset(x, x[:, :1] * 0.5 - x[:, 1:2] + 0.1)


def net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def rank_net(cage: cardcage.Cage, seed: int) -> torch.nn.Module:
    """The plain loop's weights on rank 0, others elsewhere: setup gives every rank rank 0's."""
    return net(seed + 100 * cage.global_rank)


def sgd(module: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)


def weights(*modules: torch.nn.Module) -> list[list[float]]:
    return [p.detach().cpu().reshape(-1).tolist() for m in modules for p in m.parameters()]


def plain() -> dict[str, Any]:
    """The scenarios in one process without cardcage: batches of 16."""
    loss_fn = torch.nn.functional.mse_loss
    results: dict[str, Any] = {}
    model = net(0)
    optimizer = sgd(model)
    for _ in range(EPOCHS):
        for x, y in DataLoader(data(), batch_size=16):
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
    results["parity"] = weights(model)
    model = net(0)
    optimizer = sgd(model)
    for _ in range(EPOCHS):
        for i, (x, y) in enumerate(DataLoader(data(), batch_size=8)):
            if i % 2 == 0:
                optimizer.zero_grad()
            (loss_fn(model(x), y) / 2).backward()
            if i % 2 == 1:
                optimizer.step()
    results["accumulate"] = weights(model)
    first, second = net(0), net(1)
    optimizers = [sgd(first), sgd(second)]
    for _ in range(EPOCHS):
        for x, y in DataLoader(data(), batch_size=16):
            for optimizer in optimizers:
                optimizer.zero_grad()
            loss_fn(first(x) + second(x), y).backward()
            for optimizer in optimizers:
                optimizer.step()
    results["two"] = weights(first, second)
    return results


def averaged(cage: cardcage.Cage, module: torch.nn.Module) -> bool:
    """Whether this rank's gradients equal their mean over the ranks."""
    grads = torch.cat([p.grad.reshape(-1) for p in module.parameters() if p.grad is not None])
    return bool(torch.allclose(grads, cage.all_reduce(grads.clone(), op="mean"), atol=0))


def train(cage: cardcage.Cage, out: str) -> dict[str, Any]:
    loss_fn = torch.nn.functional.mse_loss
    seen: dict[str, Any] = {"world_size": cage.world_size, "lr": []}
    results: dict[str, Any] = {}

    model = rank_net(cage, 0)
    model, optimizer = cage.setup(model, sgd(model))
    seen["lr"].append(optimizer.param_groups[0]["lr"])
    loader = cage.setup_dataloaders(DataLoader(data(), batch_size=8))
    for _ in range(EPOCHS):
        for x, y in loader:
            optimizer.zero_grad()
            cage.backward(loss_fn(model(x), y))
            optimizer.step()
    results["parity"] = weights(model)

    model = rank_net(cage, 0)
    model, optimizer = cage.setup(model, sgd(model))
    loader = cage.setup_dataloaders(DataLoader(data(), batch_size=4))
    seen["averaged"] = []
    for _ in range(EPOCHS):
        for i, (x, y) in enumerate(loader):
            if i % 2 == 0:
                optimizer.zero_grad()
            with cage.no_backward_sync(model, enabled=i % 2 == 0):
                cage.backward(loss_fn(model(x), y) / 2)
            seen["averaged"].append(averaged(cage, model))
            if i % 2 == 1:
                optimizer.step()
    results["accumulate"] = weights(model)

    first, second = rank_net(cage, 0), rank_net(cage, 1)
    first, first_optimizer = cage.setup(first, sgd(first))
    second, second_optimizer = cage.setup(second, sgd(second))
    loader = cage.setup_dataloaders(DataLoader(data(), batch_size=8))
    for _ in range(EPOCHS):
        for x, y in loader:
            first_optimizer.zero_grad()
            second_optimizer.zero_grad()
            cage.backward(loss_fn(first(x) + second(x), y))
            first_optimizer.step()
            second_optimizer.step()
    results["two"] = weights(first, second)

    Path(out, f"rank{cage.global_rank}.json").write_text(json.dumps(seen))
    return results


def main(out: Path) -> None:
    cage = cardcage.Cage(distributed_backend="ddp2", num_nodes=2)
    returned = cage.launch(train, str(out))
    rank = cage.global_rank
    (out / f"returned{rank}.json").write_text(json.dumps(returned))
    if rank == 0:
        (out / "plain.json").write_text(json.dumps(plain()))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
