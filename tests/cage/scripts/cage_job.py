"""The Cage's jobs for tests/cage: ``python cage_job.py OUT [options]``.

A file of its own because script relaunch (``ddp``) runs ``sys.argv[0]`` again in each
further rank, torchrun runs it in every process, and spawned workers import it (so the
function ``launch`` runs is a module-level one). Every process that calls ``cage.launch``
and gets a value back writes ``OUT/launch-<pid>.json`` (the value, its ``RANK`` variable);
one whose ``launch`` raises writes ``OUT/error-<pid>.json`` (the error's type and message)
and exits 3. Inside the function, each rank writes ``OUT/<section>-rank<R>.json`` for each
section it ran.

Options: ``--backend`` and ``--num-processes`` (the Cage's ``distributed_backend`` and
``num_processes``; none: ``Cage()``), ``--max-restarts``; ``--job`` names the function:

- ``sections`` (``--sections a,b``): ``parity`` (SGD with momentum, 2 epochs, the global
  batch of 16 split over the ranks; returns this rank's weights), ``collectives``,
  ``no_sync`` (3 micro-batches a step, the first two inside ``no_backward_sync``),
  ``resume`` (Adam over a shuffled loader: 3 epochs straight, and 1 epoch, ``save``, a
  model of another seed, ``load``, ``set_epoch(1)`` on a new loader, 2 epochs);
- ``misuse`` (``--misuse A,B``): one launch per mistake the Cage must refuse, each caught
  in the function, its message returned (``unpicklable`` returns an object ``launch``
  cannot hand back instead) and written to ``OUT/misuse-<NAME>.json``, with what
  ``launch`` raised if it did;
- ``fail``: rank 1 raises at its second step;
- ``stuck``: rank 1 sleeps inside the function after its first step;
- ``lone`` (``--collective NAME --lone-rank R [--late-s S]``): rank R alone calls the
  Cage's ``NAME`` (``barrier``, ``all_reduce``, ``all_gather``, ``broadcast`` from rank
  1 - R, ``save``) and the other ranks return; with ``--late-s`` every rank calls it, the
  others S seconds after rank R (late, not missing). Rank R writes
  ``OUT/lone-rank<R>.json`` (its pid, the time) just before the call;
- ``restart``: Adam over a shuffled loader for 3 epochs, saving ``OUT/resume.ckpt`` after
  each; on the first attempt rank 1 leaves with ``os._exit(1)`` at the start of the second
  epoch; an attempt that finds the file resumes from it (the loader's ``set_epoch`` at the
  saved epoch), and also trains 3 epochs straight for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, SubsetRandomSampler, TensorDataset

import cardcage

SAMPLES = 64
#: The global batch: each of 2 ranks trains on 8 of its samples, one process on all 16.
GLOBAL_BATCH = 16
EPOCHS = 2
RESUME_EPOCHS = 3
#: 6 micro-batches of 16: two optimizer steps of 3 micro-batches.
NO_SYNC_SAMPLES = 96


# -- the model, the data and the plain loop (also imported by the tests) ------------------------


def dataset(samples: int = SAMPLES) -> TensorDataset:
    """The same samples in every process and run (a seeded generator of its own)."""
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, 4, generator=generator)
    y = (x[:, :1] - 0.5 * x[:, 1:2] + 0.3 * x[:, 2:3] * x[:, 3:4]).tanh()
    return TensorDataset(x, y)


def make_model(seed: int = 0) -> torch.nn.Module:
    """A two-layer MLP whose weights come from ``seed`` alone (the global RNG is left
    alone, so every rank builds the same one)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return model


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01)


def loader(batch_size: int, samples: int = SAMPLES, *, shuffle: bool = False) -> DataLoader[Any]:
    return DataLoader(dataset(samples), batch_size=batch_size, shuffle=shuffle)


def global_batches(epoch: int) -> DataLoader[Any]:
    """Epoch ``epoch``'s global batches of a shuffled loader the Cage shards: its
    ``DistributedSampler`` (seed 0) permutes the indices by the epoch and rank r of N takes
    every N-th, so step j of the ranks together covers the permutation's j-th 16."""
    sampler = DistributedSampler(dataset(), num_replicas=1, rank=0, shuffle=True)
    sampler.set_epoch(epoch)
    return DataLoader(dataset(), batch_size=GLOBAL_BATCH, sampler=sampler)


def train(
    model: Any,
    optimizer: Any,
    batches: Any,
    epochs: int,
    backward: Callable[[torch.Tensor], None],
    *,
    start: int = 0,
) -> None:
    """The loop, the same code for the plain run and the Cage's."""
    for _ in range(start, epochs):
        for x, y in batches:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            backward(loss)
            optimizer.step()


def accumulate(
    model: Any,
    optimizer: Any,
    batches: Any,
    backward: Callable[[torch.Tensor], None],
    no_sync: Callable[[bool], Any],
    after_backward: Callable[[bool], None] = lambda inside: None,
) -> None:
    """Three micro-batches a step, each loss divided by 3; the first two inside
    ``no_sync(True)``, the third in ``no_sync(False)``. ``after_backward(inside)`` runs
    after each backward."""
    optimizer.zero_grad()
    for index, (x, y) in enumerate(batches):
        last = index % 3 == 2
        with no_sync(not last):
            loss = torch.nn.functional.mse_loss(model(x), y) / 3
            backward(loss)
        after_backward(not last)
        if last:
            optimizer.step()
            optimizer.zero_grad()


#: Optimizer steps of the warm-up: the learning rate rises from 0 to the optimizer's.
WARMUP_STEPS = 3


def warmup(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR warm-up from 0 (Accelerate's gradient_accumulation example's kind)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, step / WARMUP_STEPS))


def train_scheduled(
    model: Any,
    optimizer: Any,
    scheduler: Any,
    batches: Any,
    epochs: int,
    backward: Callable[[torch.Tensor], None],
) -> list[float]:
    """:func:`train` with ``scheduler.step()`` after each optimizer step; returns the
    learning rate each step ran with."""
    rates = []
    for _ in range(epochs):
        for x, y in batches:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            backward(loss)
            rates.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
    return rates


def weights(module: torch.nn.Module) -> list[float]:
    """Every tensor of the module's ``state_dict`` (in key order), whole and flattened (a
    sharded tensor of fsdp is gathered: every rank calls this)."""
    state = module.state_dict()
    full = [getattr(state[key], "full_tensor", state[key].detach)() for key in sorted(state)]
    return torch.cat([tensor.detach().reshape(-1).float() for tensor in full]).tolist()


def plain_backward(loss: torch.Tensor) -> None:
    loss.backward()  # type: ignore[no-untyped-call]


# -- what runs in every process -----------------------------------------------------------------


def write(out: str, name: str, data: Any) -> None:
    path = Path(out, name)
    path.with_suffix(".tmp").write_text(json.dumps(data))
    path.with_suffix(".tmp").replace(path)


def record(cage: cardcage.Cage, out: str, section: str, data: Any) -> None:
    write(out, f"{section}-rank{cage.global_rank}.json", data)


def run_sections(cage: cardcage.Cage, out: str, sections: list[str]) -> dict[str, Any]:
    value: dict[str, Any] = {"rank": cage.global_rank}
    for section in sections:
        result = SECTIONS[section](cage, out)
        record(cage, out, section, result)
        if section == "parity":
            value["weights"] = result["weights"]
    return value


def parity(cage: cardcage.Cage, out: str) -> dict[str, Any]:
    model = make_model()
    model, optimizer = cage.setup(model, sgd(model))  # created before setup (fsdp rebuilds it)
    batches = cage.setup_dataloaders(loader(GLOBAL_BATCH // cage.world_size))
    train(model, optimizer, batches, EPOCHS, cage.backward)
    return {
        "weights": weights(model),
        "keys": sorted(model.state_dict()),
        "world_size": cage.world_size,
        "restarts": cage.restarts,
        "is_sgd": isinstance(optimizer, torch.optim.SGD),
        "momentum": optimizer.param_groups[0]["momentum"],
    }


def scheduler(cage: cardcage.Cage, out: str) -> dict[str, Any]:
    """A warm-up scheduler made before setup, over the optimizer passed to setup."""
    model = make_model()
    optimizer = sgd(model)
    schedule = warmup(optimizer)  # before setup: it must drive the optimizer that steps
    model, ready = cage.setup(model, optimizer)
    batches = cage.setup_dataloaders(loader(GLOBAL_BATCH // cage.world_size))
    rates = train_scheduled(model, ready, schedule, batches, EPOCHS, cage.backward)
    inner = ready.__dict__.get("_optimizer", ready)
    return {
        "weights": weights(model),
        "initial": weights(make_model()),
        "rates": rates,
        "same_optimizer": inner is optimizer,
        "scheduler_holds_it": schedule.optimizer is inner,
        "momentum": ready.param_groups[0]["momentum"],
    }


#: The indices of the ``sampler`` section's SubsetRandomSampler.
SUBSET = [3, 7, 11, 19, 23, 31, 40, 55]


def sampler(cage: cardcage.Cage, out: str) -> dict[str, Any]:
    """A loader with a SubsetRandomSampler of its own: the indices each rank sees, by epoch."""
    indices = TensorDataset(torch.arange(SAMPLES))
    own = DataLoader(indices, batch_size=2, sampler=SubsetRandomSampler(SUBSET))
    batches = cage.setup_dataloaders(own)
    torch.manual_seed(cage.global_rank)  # ranks' random states apart: the draw must agree
    epochs = [[int(i) for (batch,) in batches for i in batch] for _ in range(2)]
    return {"epochs": epochs, "length": len(batches)}


def bf16(cage: cardcage.Cage, out: str) -> dict[str, Any]:
    """Training at the Cage's precision (``--precision bf16``): the forward's dtype, the
    weights after 2 epochs."""
    model = make_model()
    model, optimizer = cage.setup(model, sgd(model))
    batches = cage.setup_dataloaders(loader(GLOBAL_BATCH // cage.world_size))
    dtypes = set()
    for _ in range(EPOCHS):
        for x, y in batches:
            optimizer.zero_grad()
            with cage.autocast():
                prediction = model(x)
            dtypes.add(str(prediction.dtype))
            cage.backward(torch.nn.functional.mse_loss(prediction.float(), y))
            optimizer.step()
    return {"weights": weights(model), "dtypes": sorted(dtypes)}


def foreign(cage: cardcage.Cage, out: str) -> dict[str, Any]:
    """cage.setup(model, optimizer of another module): refused before any training."""
    model, other = make_model(), make_model(1)
    try:
        cage.setup(model, sgd(other))
    except cardcage.MisconfigurationError as error:
        return {"type": type(error).__name__, "message": str(error)}
    return {"type": None, "message": "no error"}


def collectives(cage: cardcage.Cage, out: str) -> dict[str, Any]:
    rank = cage.global_rank
    mine = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
    mean = cage.all_reduce(mine, op="mean")
    total = cage.all_reduce(mine, op="sum")
    gathered = cage.all_gather(torch.tensor([[rank, rank * 10]]))
    received = cage.broadcast({"from": rank, "items": [rank, "x"]}, src=1)
    # barrier: rank 1 writes a file a second late; rank 0 must find it once past the barrier
    flag = Path(out, "barrier-flag")
    if rank == 1:
        time.sleep(1.0)
        flag.write_text("1")
    cage.barrier()
    return {
        "mine": mine.tolist(),  # all_reduce returns a new tensor: the input is unchanged
        "mean": mean.tolist(),
        "sum": total.tolist(),
        "gathered": gathered.tolist(),
        "gathered_shape": list(gathered.shape),
        "broadcast": received,
        "flag_after_barrier": flag.exists(),
    }


def no_sync(cage: cardcage.Cage, out: str) -> dict[str, Any]:
    model = make_model(3)
    model, optimizer = cage.setup(model, sgd(model))
    batches = cage.setup_dataloaders(loader(GLOBAL_BATCH // cage.world_size, NO_SYNC_SAMPLES))
    # After each backward, inside no_backward_sync or not: do the ranks' gradients differ?
    differ: dict[str, list[bool]] = {"inside": [], "outside": []}

    def compare(inside: bool) -> None:
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        every = cage.all_gather(grads)
        same = all(torch.equal(every[0], other) for other in every[1:])
        differ["inside" if inside else "outside"].append(not same)

    accumulate(
        model,
        optimizer,
        batches,
        cage.backward,
        lambda enabled: cage.no_backward_sync(model, enabled=enabled),
        compare,
    )
    return {"weights": weights(model), "differ": differ}


def resume(cage: cardcage.Cage, out: str) -> dict[str, Any]:
    """Adam, 3 epochs straight; then 1 epoch, save, a model of another seed, load, 2 more."""
    size = GLOBAL_BATCH // cage.world_size
    model = make_model(5)
    model, optimizer = cage.setup(model, adam(model))
    batches = cage.setup_dataloaders(loader(size, shuffle=True))  # reshuffled each epoch
    train(model, optimizer, batches, RESUME_EPOCHS, cage.backward)
    straight = weights(model)

    first = make_model(5)
    first, first_optimizer = cage.setup(first, adam(first))
    train(
        first, first_optimizer, cage.setup_dataloaders(loader(size, shuffle=True)), 1, cage.backward
    )
    path = Path(out, "resume.ckpt")
    extra = {"epoch": 1, "note": "after one epoch", "list": [1, 2.5]}
    cage.save(path, {"model": first, "optimizer": first_optimizer, **extra})

    second = make_model(6)  # other weights: only load can make them the saved ones
    second, second_optimizer = cage.setup(second, adam(second))
    before = weights(second)
    returned = cage.load(path, {"model": second, "optimizer": second_optimizer})
    loaded = weights(second)
    batches = cage.setup_dataloaders(loader(size, shuffle=True))
    batches.set_epoch(int(returned["epoch"]))  # a new loader counts from 0: go on from 1
    train(
        second,
        second_optimizer,
        batches,
        RESUME_EPOCHS,
        cage.backward,
        start=int(returned["epoch"]),
    )
    return {
        "straight": straight,
        "resumed": weights(second),
        "saved": weights(first),
        "before_load": before,
        "loaded": loaded,
        "returned": returned,
    }


SECTIONS: dict[str, Callable[[cardcage.Cage, str], dict[str, Any]]] = {
    "parity": parity,
    "scheduler": scheduler,
    "foreign": foreign,
    "sampler": sampler,
    "bf16": bf16,
    "collectives": collectives,
    "no_sync": no_sync,
    "resume": resume,
}


class NotPlain:
    """What ``launch`` cannot hand back: a class of this script, refused by weights_only."""

    def __init__(self, value: int) -> None:
        self.value = value


def misuse(cage: cardcage.Cage, out: str, name: str) -> Any:
    """Make the mistake ``name``; return the message of the error the Cage raised."""
    if name == "unpicklable":
        return NotPlain(cage.global_rank)
    model = make_model()
    ready = cage.setup(model, sgd(model))[0]
    x, y = dataset()[:8]
    try:
        if name == "original-module":
            cage.setup_dataloaders(loader(8))
            cage.backward(torch.nn.functional.mse_loss(model(x), y))  # not the set-up module
        elif name == "no-loader":
            cage.backward(torch.nn.functional.mse_loss(ready(x), y))
        else:
            raise ValueError(name)
    except cardcage.MisconfigurationError as error:
        return {"type": type(error).__name__, "message": str(error)}
    return {"type": None, "message": "no error"}


def fail(cage: cardcage.Cage, out: str) -> Any:
    model = make_model()
    model, optimizer = cage.setup(model, sgd(model))
    batches = cage.setup_dataloaders(loader(8))
    for step, (x, y) in enumerate(batches, 1):
        if cage.global_rank == 1 and step == 2:
            write(out, "raised-rank1.json", {"time": time.time(), "pid": os.getpid()})
            raise RuntimeError("rank 1 gives up at its second step")
        optimizer.zero_grad()
        cage.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
    return {"rank": cage.global_rank}


def stuck_here(seconds: float) -> None:
    time.sleep(seconds)


def stuck(cage: cardcage.Cage, out: str) -> Any:
    model = make_model()
    model, optimizer = cage.setup(model, sgd(model))
    batches = cage.setup_dataloaders(loader(8))
    for step, (x, y) in enumerate(batches, 1):
        if cage.global_rank == 1 and step == 2:
            write(out, "stuck-rank1.json", {"time": time.time(), "pid": os.getpid()})
            stuck_here(300)
        optimizer.zero_grad()
        cage.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
    return {"rank": cage.global_rank}


def lone(cage: cardcage.Cage, out: str, name: str, lone_rank: int, late_s: float) -> Any:
    model = cage.setup(make_model())
    calls: dict[str, Callable[[], Any]] = {
        "barrier": cage.barrier,
        "all_reduce": lambda: cage.all_reduce(torch.ones(2)),
        "all_gather": lambda: cage.all_gather(torch.ones(2)),
        # from the other rank: one from this rank would meet the other's hand-back of
        # its value (a broadcast from rank 0 too) and end, wrongly, without waiting
        "broadcast": lambda: cage.broadcast({"from": cage.global_rank}, src=1 - lone_rank),
        "save": lambda: cage.save(Path(out, "lone.ckpt"), {"model": model, "step": 1}),
    }
    cage.barrier()  # every rank set up: the one call below starts together
    if cage.global_rank == lone_rank:
        write(out, f"lone-rank{lone_rank}.json", {"time": time.time(), "pid": os.getpid()})
        calls[name]()
    elif late_s:
        time.sleep(late_s)
        calls[name]()
    return {"rank": cage.global_rank}


def restart(cage: cardcage.Cage, out: str) -> dict[str, Any]:
    size = GLOBAL_BATCH // cage.world_size
    path = Path(out, "resume.ckpt")
    seen = {"restarts": cage.restarts, "env": os.environ.get("CARDCAGE_RESTARTS")}
    write(out, f"attempt{cage.restarts}-rank{cage.global_rank}.json", seen)
    model = make_model(7)
    model, optimizer = cage.setup(model, adam(model))
    batches = cage.setup_dataloaders(loader(size, shuffle=True))
    start = 0
    if path.exists():
        start = int(cage.load(path, {"model": model, "optimizer": optimizer})["epoch"])
        batches.set_epoch(start)  # the shuffle order of the epoch it resumes at
    for epoch in range(start, RESUME_EPOCHS):
        if epoch == 1 and cage.restarts == 0 and cage.global_rank == 1:
            os._exit(1)  # dies without a word, on the first attempt only
        train(model, optimizer, batches, epoch + 1, cage.backward, start=epoch)
        cage.save(path, {"model": model, "optimizer": optimizer, "epoch": epoch + 1})
    value = {"rank": cage.global_rank, "restarts": cage.restarts, "start": start}
    value["weights"] = weights(model)
    if start > 0:  # a resumed attempt: the same training without interruption, to compare
        straight = make_model(7)
        straight, straight_optimizer = cage.setup(straight, adam(straight))
        batches = cage.setup_dataloaders(loader(size, shuffle=True))
        train(straight, straight_optimizer, batches, RESUME_EPOCHS, cage.backward)
        value["straight"] = weights(straight)
    write(out, f"restart-rank{cage.global_rank}.json", value)
    return value


JOBS: dict[str, Callable[..., Any]] = {
    "fail": fail,
    "stuck": stuck,
    "restart": restart,
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--job", default="sections")
    parser.add_argument("--sections", default="parity")
    parser.add_argument("--misuse", default="")
    parser.add_argument("--backend")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("--precision", default="32")
    parser.add_argument("--collective", default="barrier")
    parser.add_argument("--lone-rank", type=int, default=0)
    parser.add_argument("--late-s", type=float, default=0.0)
    options = parser.parse_args()
    precision = int(options.precision) if options.precision.isdigit() else options.precision
    flags: dict[str, Any] = {"max_restarts": options.max_restarts, "precision": precision}
    if options.backend is not None:
        flags.update(distributed_backend=options.backend, num_processes=options.num_processes)
    cage = cardcage.Cage(**flags)
    out = options.out
    if options.job == "misuse":  # one launch per mistake, each recorded, in this one script
        for name in options.misuse.split(","):
            try:
                value = cage.launch(misuse, out, name)
            except Exception as error:
                value = {"launch_raised": type(error).__name__, "message": str(error)}
            write(out, f"misuse-{name}.json", value)
        return 0
    try:
        if options.job == "sections":
            value = cage.launch(run_sections, out, options.sections.split(","))
        elif options.job == "lone":
            args = (options.collective, options.lone_rank, options.late_s)
            value = cage.launch(lone, out, *args)
        else:
            value = cage.launch(JOBS[options.job], out)
    except Exception as error:
        raised = {"type": type(error).__name__, "message": str(error)}
        write(out, f"error-{os.getpid()}.json", raised)
        raise SystemExit(3) from error
    write(out, f"launch-{os.getpid()}.json", {"value": value, "rank": os.environ.get("RANK")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
