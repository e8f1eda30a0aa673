"""Per-step overhead and peak memory of cardcage against a plain PyTorch loop (and Lightning).

Both ways of training with cardcage are measured: its ``Trainer`` (the loop is cardcage's)
and ``cardcage.Cage`` (the user's own loop, beside Lightning Fabric and Accelerate).

Usage::

    python benchmarks/overhead.py                # full: 9 rounds x 2000 steps per variant
    python benchmarks/overhead.py --quick        # 3 rounds x 600 steps: a smoke run
    python benchmarks/overhead.py --rounds 15 --steps 4000 --json results.json
    python benchmarks/overhead.py --loader batched   # cheaper batches: overhead shows more
    python benchmarks/overhead.py --profile cardcage --width 32   # where the time goes
    python benchmarks/overhead.py --step-checkpoints 100   # what step checkpoints cost
    python benchmarks/overhead.py --paired 8 --rounds 6    # the loop's own cost, in one process
    python benchmarks/overhead.py --control --json a.json  # with an A/A control (plain twice)
    python benchmarks/overhead.py --pool a.json b.json     # the rounds of several runs together
    python benchmarks/overhead.py --own-loop   # only plain, cage, fabric and accelerate

What it compares, on the CPU with one thread (``torch.set_num_threads(1)``):

* ``plain``: a hand-written loop (``for batch_idx, batch in enumerate(loader)``: ``zero_grad``,
  ``training_step``, ``backward``, ``step``), no progress bar;
* ``cardcage``: ``cardcage.Trainer(distributed_backend="cpu", max_steps=N, progress_bar=True)``;
* ``cardcage-ckpt-N`` (with ``--step-checkpoints N``): the same with
  ``checkpoint_every_n_steps=N``, a step checkpoint written every N steps (what
  ``max_restarts`` turns on, every 100 steps by default);
* ``plain.again`` (with ``--control``): the plain loop a second time in every round, judged
  like cardcage against the first: an A/A control whose ratio would be 1.000 on a quiet
  machine, so its distance from 1 is the noise floor of the run's ratios;
* ``lightning``: ``pytorch_lightning.Trainer`` (or ``lightning.pytorch``'s) with
  ``logger=False, enable_checkpointing=False, enable_model_summary=False``, its progress bar
  on, ``accelerator="cpu", devices=1``; only when one of the two is importable (the ``bench``
  extra of the top-level ``pyproject.toml`` installs it).

The own-loop variants run the plain loop above, line for line, written as each library has
its users write it, through the library's launcher where it has one. Their ``fit`` time is
that call: making the optimizer, the set-up calls and the loop.

* ``cage``: ``cardcage.Cage(distributed_backend="cpu")`` (one process), ``cage.launch(fn)``; in
  ``fn``: ``model, optimizer = cage.setup(model, optimizer)``, ``loader =
  cage.setup_dataloaders(loader)``, ``cage.backward(loss)`` in place of ``loss.backward()``;
* ``fabric``: ``Fabric(accelerator="cpu", devices=1)``, ``fabric.launch(fn)``, the same calls
  on ``fabric`` (``from lightning.fabric import Fabric``, else ``lightning_fabric``); only
  when importable;
* ``accelerate``: ``Accelerator(cpu=True)``; ``model, optimizer, loader =
  accelerator.prepare(...)`` and ``accelerator.backward(loss)``, the loop called in this
  process (one process needs no launcher in Accelerate); only when importable.

Each calls ``training_step`` on the model its library handed back (for ``cage`` on one CPU
process that is the user's module; Fabric's wrapper passes ``training_step``, one of the step
methods it knows, to the module). None has a progress bar. ``--own-loop`` runs only these and
``plain``; by default every variant runs.

Every variant trains the same module (the same ``training_step`` and ``configure_optimizers``;
Lightning's is a ``LightningModule`` with that body) on the same data: a ``TensorDataset`` of
32 features and 10 classes in a ``DataLoader(batch_size=64, shuffle=False)``, SGD with
momentum, cross entropy, the same seeds and the same number of steps; the trained weights are
compared with the plain loop's. Two models: ``tiny`` (an MLP of hidden width 32, where the
framework's overhead is as large a share of a step as it gets) and ``mlp`` (hidden width 256).
The progress bars write to a real stream (the child's stdout and stderr go to a log file), so
tqdm does its real work. ``--loader batched`` draws each batch with one index operation
(``batch_size=None`` over a ``BatchSampler``) instead of 64 ``__getitem__`` calls and a
collate: the same batches at a fraction of the cost, so the overhead is a larger share.

Each variant runs in a fresh subprocess (imports and memory are its own), and the variants
are interleaved: every round runs each one once, in a shuffled order, so that load from
other processes on the machine hits all of them alike. torch's one-time lazy import of
``torch._dynamo`` (on the first optimizer) is paid before any timing, in every variant.
Right before the timed region every variant collects garbage and calls ``gc.freeze()``
(``--gc default`` does not): a full collection walks torch's whole import heap (~140 ms
here), and where the two or three of a run land, inside the steady window or not, decided
more of a ratio than the framework did. The collections each variant still makes while it
trains, and their time, are reported.

Timings, per step:

* ``steady``: from the first step of the second epoch to the first step of the last epoch
  (the module records the time when ``training_step`` sees ``batch_idx == 0``), divided by
  the steps in between: no warm-up, no setup or teardown, but the per-epoch work (a new
  loader iterator, a new bar) is in.
* ``fit``: ``perf_counter`` around ``trainer.fit(...)``, divided by the steps; for ``plain``,
  around making the optimizer and the loop.

For each, ``ratio`` is the median over rounds of the variant's time divided by the plain
loop's in the same round, with the quartiles; ``best`` divides the variant's fastest run by
plain's fastest (less sensitive to bursts of load); ``CPU`` is the median ratio of
``process_time`` instead of wall-clock time (what the process itself spent, the least
sensitive to other processes). Peak RSS is the child's ``ru_maxrss`` when it has finished:
the whole process, imports included (``import cardcage`` loads pluggy and every installed
backend plugin; Lightning loads far more), with its median difference from plain's.

Targets for cardcage against plain: time ratio at most 1.05 for ``tiny`` and 1.02 for
``mlp``, on both ``steady`` and ``fit``; peak RSS at most 5 MiB above plain. Lightning, Fabric
and Accelerate are shown for reference (Lightning is known to use 17-22 MiB more than plain).
``cage`` is measured, not judged here: its target (1.01 of plain) is on the instruction count
of ``instructions.py``, finer than the wall-clock noise of this benchmark. The ``result``
column judges the wall-clock medians, then the CPU-time medians (``wall/CPU``); the RSS delta
counts in both.
A missed target is a finding, not an error: the exit status is non-zero only when a run
fails. On a loaded machine use more rounds and steps, and read the quartiles.

Two fresh processes of the same code differ by up to 3% a step here (where each lands in
memory), so a 15-round median of the mlp's ratio moves by about +-0.8%, close to the 2% the
target allows. ``--pool`` judges the rounds of several ``--json`` runs together: the median
of every per-round ratio, with a 95% bootstrap interval.

``--paired PAIRS`` alternates PAIRS epochs of the plain loop and of cardcage in one process
per round and model, each timed inside the epoch: the loop's own cost a step, with the
host's drift cancelled (see ``paired_child``); not what a fresh process pays on top.

``--profile VARIANT`` trains VARIANT and the plain loop in this process under cProfile and
prints the functions that took the most per step, then every call per step VARIANT makes
beyond the plain loop: its overhead, call by call.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

FEATURES = 32
CLASSES = 10
BATCH = 64
MODELS = {"tiny": 32, "mlp": 256}
TIME_TARGETS = {"tiny": 1.05, "mlp": 1.02}
RSS_TARGET_MIB = 5.0
TIMINGS = ("steady_step_s", "fit_step_s", "steady_cpu_step_s", "fit_cpu_step_s")
# the user's own loop, each library's way; the others are trainers (their loop, not the user's)
OWN_LOOPS = ("cage", "fabric", "accelerate")
INSTALL = {
    "cage": "pip install -e core",
    "fabric": "pip install lightning",
    "accelerate": "pip install accelerate",
}


# -- one variant, one process ------------------------------------------------------------------


def _lightning() -> Any:
    """The Lightning package: ``pytorch_lightning``, else ``lightning.pytorch``."""
    try:
        import pytorch_lightning as pl
    except ImportError:
        import lightning.pytorch as pl  # type: ignore[no-redef]
    return pl


def _installed(candidates: tuple[tuple[str, str], ...]) -> str | None:
    """The first importable ``(module, distribution)`` as "distribution version", without
    importing it (the parent process stays small: no torch)."""
    import importlib.metadata as md
    import importlib.util

    for module, dist in candidates:
        if importlib.util.find_spec(module) is not None:
            try:
                return f"{dist} {md.version(dist)}"
            except md.PackageNotFoundError:
                return module
    return None


def lightning_available() -> str | None:
    """The importable Lightning distribution and version, without importing it."""
    return _installed((("pytorch_lightning", "pytorch-lightning"), ("lightning", "lightning")))


def lightning_note(found: str | None, own_loop: bool, no_lightning: bool) -> str:
    """What the run says of Lightning's Trainer variant."""
    if own_loop or no_lightning:
        return "left out (" + ("--own-loop" if own_loop else "--no-lightning") + ")"
    return found or "not installed, skipped (pip install -e .[bench])"


def _fabric() -> Any:
    """Lightning Fabric's ``Fabric`` class: ``lightning.fabric``'s, else ``lightning_fabric``'s."""
    try:
        from lightning.fabric import Fabric
    except ImportError:
        from lightning_fabric import Fabric  # type: ignore[no-redef]
    return Fabric


def own_loop_available() -> dict[str, str | None]:
    """Per own-loop variant, what provides it ("distribution version"), or None: not
    importable here. ``cage`` is this repository's cardcage."""
    return {
        "cage": _installed((("cardcage", "cardcage-core"),)),
        # pytorch-lightning ships lightning_fabric as a module of its own distribution
        "fabric": _installed(
            (
                ("lightning", "lightning"),
                ("lightning_fabric", "lightning-fabric"),
                ("lightning_fabric", "pytorch-lightning"),
            )
        ),
        "accelerate": _installed((("accelerate", "accelerate"),)),
    }


def build(
    framework: str, width: int, steps_per_epoch: int, loader_kind: str = "default", seed: int = 0
) -> tuple[Any, Any]:
    """The module and the loader every variant trains on (imports the framework)."""
    import torch
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

    base: type[nn.Module] = nn.Module
    if framework == "lightning":
        base = _lightning().LightningModule
    elif framework.startswith("cardcage") or framework == "cage":
        import cardcage  # (part of what cardcage costs: pluggy, the plugins)

        if framework == "cardcage-log":  # self.log of one value a step
            base = cardcage.Module
    elif framework == "fabric":
        _fabric()  # the import, before any timing as for the others
    elif framework == "accelerate":
        import accelerate  # noqa: F401
    logs = framework == "cardcage-log"

    perf_counter, process_time = time.perf_counter, time.process_time

    class Model(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(FEATURES, width),
                nn.ReLU(),
                nn.Linear(width, width),
                nn.ReLU(),
                nn.Linear(width, CLASSES),
            )
            # (perf_counter(), process_time()) at the first step of each epoch
            self.marks: list[tuple[float, float]] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if batch_idx == 0:
                self.marks.append((perf_counter(), process_time()))
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            if logs:
                self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    # torch imports torch._dynamo (seconds) when the first optimizer is made: a cost of torch,
    # the same for every variant, paid here, before any timing.
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    torch.manual_seed(seed)
    n = steps_per_epoch * BATCH
    dataset = TensorDataset(torch.randn(n, FEATURES), torch.randint(0, CLASSES, (n,)))
    if loader_kind == "batched":
        sampler = BatchSampler(SequentialSampler(dataset), BATCH, drop_last=False)
        loader = DataLoader(dataset, sampler=sampler, batch_size=None)
    else:
        loader = DataLoader(dataset, batch_size=BATCH, shuffle=False)
    torch.manual_seed(seed + 1)
    return Model(), loader


class Collections:
    """Garbage collections per generation, and the seconds they took, while it is on."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._started

    def __enter__(self) -> Collections:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def settle(gc_mode: str) -> None:
    """Right before the timed region, the same in every variant.

    ``freeze``: collect, then move everything alive (torch's import heap above all) to the
    permanent generation. A full collection walks that heap in ~140 ms here; two or three
    land somewhere in a 2000-step run, inside the steady window in some runs and outside it in
    others, which made per-round ratios swing by +-10%. Frozen, a full collection only walks
    what the run itself allocated, so a framework that allocates more still pays for it.
    ``default``: leave the collector alone.
    """
    if gc_mode == "freeze":
        gc.collect()
        gc.freeze()


def cage_loop(cage: Any, model: Any, loader: Any, steps: int) -> int:
    """The plain loop of :func:`train`, written for ``cardcage.Cage``; ``cage.launch`` runs it.

    The lines the plain loop does not have: ``cage.setup``, ``cage.setup_dataloaders`` and
    ``cage.backward``. Module-level, as a function a spawning backend pickles must be.
    """
    optimizer = model.configure_optimizers()
    model, optimizer = cage.setup(model, optimizer)
    loader = cage.setup_dataloaders(loader)
    model.train()
    step = 0
    while step < steps:
        for batch_idx, batch in enumerate(loader):
            optimizer.zero_grad()
            loss = model.training_step(batch, batch_idx)
            cage.backward(loss)
            optimizer.step()
            step += 1
            if step >= steps:
                break
    return step


def fabric_loop(fabric: Any, model: Any, loader: Any, steps: int) -> int:
    """The plain loop, written for Lightning Fabric; ``fabric.launch`` runs it."""
    optimizer = model.configure_optimizers()
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(loader)
    model.train()
    step = 0
    while step < steps:
        for batch_idx, batch in enumerate(loader):
            optimizer.zero_grad()
            loss = model.training_step(batch, batch_idx)
            fabric.backward(loss)
            optimizer.step()
            step += 1
            if step >= steps:
                break
    return step


def accelerate_loop(accelerator: Any, model: Any, loader: Any, steps: int) -> int:
    """The plain loop, written for HuggingFace Accelerate (``prepare``, ``backward``)."""
    optimizer = model.configure_optimizers()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    step = 0
    while step < steps:
        for batch_idx, batch in enumerate(loader):
            optimizer.zero_grad()
            loss = model.training_step(batch, batch_idx)
            accelerator.backward(loss)
            optimizer.step()
            step += 1
            if step >= steps:
                break
    return step


def own_loop(
    framework: str, model: Any, loader: Any, steps: int, gc_mode: str
) -> tuple[float, float, int, Collections]:
    """:func:`train` for the own-loop variants: the library's object is made first (as the
    Trainer is, outside the timed region); timed: the launch, or the loop's call."""
    perf_counter, process_time = time.perf_counter, time.process_time
    if framework == "cage":
        import cardcage

        cage = cardcage.Cage(distributed_backend="cpu")
        assert cage.selection.accelerator == "cpu", cage.selection

        def run() -> int:
            return int(cage.launch(cage_loop, model, loader, steps))

    elif framework == "fabric":
        fabric = _fabric()(accelerator="cpu", devices=1)

        def run() -> int:
            return int(fabric.launch(fabric_loop, model, loader, steps))

    elif framework == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)

        def run() -> int:
            return accelerate_loop(accelerator, model, loader, steps)

    else:
        raise ValueError(f"unknown framework {framework!r}")
    settle(gc_mode)
    with Collections() as collections:
        start, cpu = perf_counter(), process_time()
        done = run()
        elapsed, cpu = perf_counter() - start, process_time() - cpu
    return elapsed, cpu, done, collections


def train(
    framework: str,
    model: Any,
    loader: Any,
    steps: int,
    gc_mode: str = "freeze",
    bar: bool = True,
) -> tuple[float, float, int, Collections]:
    """Train for ``steps`` steps; return wall and CPU seconds around ``fit``, the steps, and
    the garbage collections in between.

    For ``plain`` the timed region is what ``fit`` does for the others: make the optimizer,
    put the module in training mode, loop. The own-loop variants: see :func:`own_loop`.
    """
    perf_counter, process_time = time.perf_counter, time.process_time
    if framework in OWN_LOOPS:
        return own_loop(framework, model, loader, steps, gc_mode)
    if framework.startswith("plain"):  # plain, or plain.again (--control)
        settle(gc_mode)
        with Collections() as collections:
            start, cpu = perf_counter(), process_time()
            optimizer = model.configure_optimizers()
            model.train()
            step = 0
            while step < steps:
                for batch_idx, batch in enumerate(loader):
                    optimizer.zero_grad()
                    loss = model.training_step(batch, batch_idx)
                    loss.backward()
                    optimizer.step()
                    step += 1
                    if step >= steps:
                        break
            elapsed, cpu = perf_counter() - start, process_time() - cpu
        return elapsed, cpu, step, collections
    if framework.startswith("cardcage"):
        import cardcage

        # cardcage-ckpt-N: a step checkpoint (last.ckpt, atomically replaced) every N steps;
        # cardcage-log: the model logs a value a step, read every 50 steps (Lightning's default)
        every = int(framework.rpartition("-")[2]) if framework.startswith("cardcage-ckpt") else None
        trainer = cardcage.Trainer(
            distributed_backend="cpu",
            max_epochs=None,
            max_steps=steps,
            progress_bar=bar,
            checkpoint_every_n_steps=every,
        )
        assert trainer.selection.accelerator == "cpu", trainer.selection
    elif framework == "lightning":
        trainer = _lightning().Trainer(
            max_steps=steps,
            max_epochs=-1,
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=bar,
            accelerator="cpu",
            devices=1,
        )
    else:
        raise ValueError(f"unknown framework {framework!r}")
    settle(gc_mode)
    with Collections() as collections:
        start, cpu = perf_counter(), process_time()
        trainer.fit(model, loader)
        elapsed, cpu = perf_counter() - start, process_time() - cpu
    return elapsed, cpu, int(trainer.global_step), collections


def weights_digest(model: Any) -> str:
    """A digest of the trained weights, to check that two variants did the same work."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one variant in this (fresh) process and return its measurements."""
    import torch

    torch.set_num_threads(1)
    steps, steps_per_epoch = spec["steps"], spec["steps_per_epoch"]
    start = time.perf_counter()
    model, loader = build(spec["framework"], spec["width"], steps_per_epoch, spec["loader"])
    setup_s = time.perf_counter() - start
    elapsed, cpu, done, collections = train(
        spec["framework"], model, loader, steps, spec.get("gc", "freeze")
    )
    marks = model.marks
    steady = steady_cpu = None
    if len(marks) >= 3:
        between = (len(marks) - 2) * steps_per_epoch
        steady = (marks[-1][0] - marks[1][0]) / between
        steady_cpu = (marks[-1][1] - marks[1][1]) / between
    return {
        **spec,
        "steps_done": done,
        "epochs_seen": len(marks),
        "steady_step_s": steady,
        "fit_step_s": elapsed / max(done, 1),
        "steady_cpu_step_s": steady_cpu,
        "fit_cpu_step_s": cpu / max(done, 1),
        "setup_s": setup_s,
        "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "digest": weights_digest(model),
        "torch_threads": torch.get_num_threads(),
        "gc_count": collections.count,
        "gc_s": collections.seconds,
    }


def run_child(spec: dict[str, Any], log_dir: str) -> dict[str, Any]:
    """Run ``spec`` in a fresh interpreter, its output (the bars) going to a log file."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
    name = f"{spec['framework']}-{spec['model']}-{spec['round']}"
    log_path = os.path.join(log_dir, name + ".log")
    out_path = os.path.join(log_dir, name + ".json")
    command = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [*command, "--child-out", out_path],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=env,
            timeout=1800,
            check=False,
        )
    if proc.returncode != 0 or not os.path.exists(out_path):
        with open(log_path, errors="replace") as log:
            tail = log.read()[-4000:]
        raise RuntimeError(
            f"{spec['framework']}/{spec['model']} (round {spec['round'] + 1}) failed with exit "
            f"status {proc.returncode}; the end of its output:\n{tail}"
        )
    with open(out_path) as f:
        result: dict[str, Any] = json.load(f)
    result["log_bytes"] = os.path.getsize(log_path)
    return result


def paired_child(spec: dict[str, Any]) -> dict[str, Any]:
    """``--paired``: in this one process, alternate epochs of the plain loop and of cardcage
    (a ``fit`` of one epoch, progress bar on), on two copies of the model that they swap
    every pair, and time each between its batches ``lo`` and ``hi`` (a tenth of an epoch in
    from either end, so no per-epoch work is in): what the loop itself costs a step, with
    the host's drift and the process's state the same for both."""
    import copy

    import torch

    torch.set_num_threads(1)
    spe = spec["steps_per_epoch"]
    lo, hi = spe // 10, spe - spe // 10
    base, loader = build("cardcage", spec["width"], spe, spec["loader"])
    perf_counter = time.perf_counter

    def timed(model: Any) -> Any:
        model.window = {}
        step = model.training_step

        def training_step(batch: Any, batch_idx: int) -> Any:
            if batch_idx in (lo, hi):
                model.window[batch_idx] = perf_counter()
            return step(batch, batch_idx)

        model.training_step = training_step
        return model

    # Two copies of the weights, and each loop trains each in half the pairs: where a copy's
    # tensors sit in memory moves its step by about 1% (the plain loop against itself, one
    # copy each: 0.97-1.005), which would otherwise count for or against cardcage.
    twin = copy.deepcopy(base)  # before timed(): a copied wrapper would call base's step
    copies = [timed(base), timed(twin)]

    def epoch(framework: str, model: Any) -> float:
        train(framework, model, loader, spe, spec["gc"])
        return float((model.window[hi] - model.window[lo]) / (hi - lo))

    for framework, model in zip(("plain", "cardcage"), copies, strict=True):  # warm-up
        epoch(framework, model)
    rng = random.Random(spec["round"])
    pairs = []
    for index in range(spec["pairs"]):
        given = {"plain": copies[index % 2], "cardcage": copies[1 - index % 2]}
        order = list(given)
        rng.shuffle(order)
        seconds = {framework: epoch(framework, given[framework]) for framework in order}
        pairs.append((seconds["plain"], seconds["cardcage"]))
    return {**spec, "pairs_s": pairs}


def paired(rounds: int, pairs: int, spe: int, loader: str, gc_mode: str) -> None:
    """``--paired``: each round a fresh process per model running :func:`paired_child`."""
    print(
        f"overhead --paired: {rounds} rounds x {len(MODELS)} processes, each {pairs} pairs of "
        f"epochs of {spe} steps (plain, cardcage in a shuffled order), timed from batch "
        f"{spe // 10} to {spe - spe // 10}",
        flush=True,
    )
    ratios: dict[str, list[float]] = {model: [] for model in MODELS}
    per_round: dict[str, list[float]] = {model: [] for model in MODELS}
    seconds: dict[str, list[tuple[float, float]]] = {model: [] for model in MODELS}
    with tempfile.TemporaryDirectory(prefix="cardcage-overhead-") as log_dir:
        for index in range(rounds):
            for model in MODELS:
                spec = {
                    "framework": "paired",
                    "model": model,
                    "width": MODELS[model],
                    "steps_per_epoch": spe,
                    "pairs": pairs,
                    "loader": loader,
                    "gc": gc_mode,
                    "round": index,
                }
                result = run_child(spec, log_dir)
                these = [c / p for p, c in result["pairs_s"]]
                ratios[model] += these
                per_round[model].append(statistics.median(these))
                seconds[model] += result["pairs_s"]
            print(f"  round {index + 1}/{rounds} done", flush=True)
    print(
        f"\n{'model':<13}{'plain us':>9}{'cardcage us':>12}  {'ratio [q1-q3] of pairs':<24}"
        f"{'rounds min-max':<15}target"
    )
    for model in MODELS:
        q1, q2, q3 = _quartiles(ratios[model])
        plain_us = statistics.median(p for p, _ in seconds[model]) * 1e6
        cardcage_us = statistics.median(c for _, c in seconds[model]) * 1e6
        print(
            f"{model + f' (w={MODELS[model]})':<13}{plain_us:>9.1f}{cardcage_us:>12.1f}  "
            f"{f'{q2:.3f} [{q1:.3f}-{q3:.3f}]':<24}"
            f"{f'{min(per_round[model]):.3f}-{max(per_round[model]):.3f}':<15}"
            f"<={TIME_TARGETS[model]:.2f}x"
        )
    print(
        "\nThe loop's own cost a step, in a process that imported cardcage for both: not what "
        "a fresh process pays beyond plain (imports, setup, per-epoch work): the default mode "
        "measures that."
    )


# -- statistics and the table ------------------------------------------------------------------


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def summarise(results: list[dict[str, Any]], frameworks: list[str]) -> list[dict[str, Any]]:
    """One row per model and framework: medians, per-round ratios to plain, RSS, verdict."""
    by: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for result in results:
        by.setdefault((result["framework"], result["model"]), {})[result["round"]] = result
    rows = []
    for model in MODELS:
        plain = by[("plain", model)]
        for framework in frameworks:
            runs = by[(framework, model)]
            rounds = sorted(runs)
            row: dict[str, Any] = {"model": model, "framework": framework}
            for key in TIMINGS:
                values = [runs[i][key] for i in rounds if runs[i][key] is not None]
                base = [plain[i][key] for i in rounds if plain[i][key] is not None]
                ratios = [
                    runs[i][key] / plain[i][key]
                    for i in rounds
                    if runs[i][key] is not None and plain[i][key]
                ]
                row[key] = statistics.median(values) if values else None
                row[key + "_ratio"] = _quartiles(ratios) if ratios else None
                row[key + "_best"] = min(values) / min(base) if values and base else None
            row["rss_mib"] = statistics.median(runs[i]["maxrss_kib"] / 1024 for i in rounds)
            row["rss_delta_mib"] = statistics.median(
                (runs[i]["maxrss_kib"] - plain[i]["maxrss_kib"]) / 1024 for i in rounds
            )
            row["setup_s"] = statistics.median(runs[i]["setup_s"] for i in rounds)
            row["same_weights"] = all(runs[i]["digest"] == plain[i]["digest"] for i in rounds)
            row["steps_ok"] = all(runs[i]["steps_done"] == runs[i]["steps"] for i in rounds)
            row["log_bytes"] = statistics.median(runs[i]["log_bytes"] for i in rounds)
            row["gc_full"] = statistics.median(runs[i]["gc_count"][2] for i in rounds)
            row["gc_all"] = statistics.median(sum(runs[i]["gc_count"]) for i in rounds)
            row["gc_ms"] = statistics.median(1000 * runs[i]["gc_s"] for i in rounds)
            row["target"], row["verdict"] = {
                "plain": ("baseline", None),
                "plain.again": ("A/A control", None),
                "lightning": ("reference", None),
                "fabric": ("reference", None),
                "accelerate": ("reference", None),
                "cage": ("measured", None),
            }.get(framework, (f"<={TIME_TARGETS[model]:.2f}x, <=+{RSS_TARGET_MIB:.0f} MiB", None))
            if framework.startswith("cardcage-ckpt"):
                row["target"] = "measured"
            if framework == "cardcage":
                rss_ok = row["rss_delta_mib"] <= RSS_TARGET_MIB
                verdicts = []
                for keys in (
                    ("steady_step_s", "fit_step_s"),
                    ("steady_cpu_step_s", "fit_cpu_step_s"),
                ):
                    ok = rss_ok and all(
                        row[k + "_ratio"] is None or row[k + "_ratio"][1] <= TIME_TARGETS[model]
                        for k in keys
                    )
                    verdicts.append("pass" if ok else "MISS")
                row["verdict"] = "/".join(verdicts)
            rows.append(row)
    return rows


def _ratio(row: dict[str, Any], key: str) -> str:
    if row["framework"] == "plain":
        return "1"
    q = row[key + "_ratio"]
    best = row[key + "_best"]
    if q is None:
        return "-"
    return f"{q[1]:.3f} [{q[0]:.3f}-{q[2]:.3f}] {best:.3f}"


def print_table(rows: list[dict[str, Any]]) -> None:
    headers = [
        "model",
        "variant",
        "steady us/step",
        "ratio [q1-q3] best",
        "fit us/step",
        "ratio [q1-q3] best",
        "CPU ratio st/fit",
        "peak RSS MiB",
        "RSS delta",
        "target",
        "result wall/CPU",
    ]
    table = []
    for row in rows:
        base = row["framework"] == "plain"
        steady = row["steady_step_s"]
        cpu = [row[k + "_ratio"] for k in ("steady_cpu_step_s", "fit_cpu_step_s")]
        table.append(
            [
                f"{row['model']} (w={MODELS[row['model']]})",
                row["framework"],
                f"{steady * 1e6:.1f}" if steady is not None else "-",
                _ratio(row, "steady_step_s"),
                f"{row['fit_step_s'] * 1e6:.1f}",
                _ratio(row, "fit_step_s"),
                "1" if base else "/".join(f"{q[1]:.3f}" if q else "-" for q in cpu),
                f"{row['rss_mib']:.1f}",
                "-" if base else f"{row['rss_delta_mib']:+.1f}",
                row["target"],
                row["verdict"] or "-",
            ]
        )
    widths = [max(len(h), *(len(r[i]) for r in table)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    print(line)
    print("-" * len(line))
    previous = None
    for cells, row in zip(table, rows, strict=True):
        if previous is not None and row["model"] != previous:
            print()
        previous = row["model"]
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
    print(
        "\nus/step: median wall-clock time per step. steady: second epoch to last epoch; fit: "
        "around fit()\n(plain: around making the optimizer and the loop). ratio: median over "
        "rounds of the per-round\nratio to plain [quartiles]; best: fastest run / plain's "
        "fastest. CPU ratio: median per-round\nratio of process_time (steady/fit). result: "
        "cardcage's targets judged on the wall-clock\nmedians / on the CPU-time medians; "
        "peak RSS (whole process, imports included) counts in both."
    )


# -- profiling ---------------------------------------------------------------------------------


def _profiled(framework: str, width: int, steps: int, spe: int, loader: str) -> tuple[Any, int]:
    import cProfile
    import pstats

    model, data = build(framework, width, spe, loader)
    profiler = cProfile.Profile()
    with open(os.devnull, "w") as devnull:  # the bars write somewhere real, but not here
        stderr, stdout = sys.stderr, sys.stdout
        sys.stderr = sys.stdout = devnull
        try:
            profiler.enable()
            _, _, done, _ = train(framework, model, data, steps)
            profiler.disable()
        finally:
            sys.stderr, sys.stdout = stderr, stdout
    return pstats.Stats(profiler), done


def _where(key: tuple[str, int, str]) -> str:
    file, line, name = key
    if file.startswith("/"):
        file = os.path.relpath(file).split("site-packages/", 1)[-1]
    return f"{file}:{line}({name})"


def profile(framework: str, width: int, steps: int, spe: int, loader: str, top: int) -> None:
    """Train ``framework`` and ``plain`` here under cProfile; print where the time goes.

    First the functions that took the most time per step; then every function the framework
    calls more often per step than the plain loop does: its overhead, call by call. The
    profile covers ``Trainer(...)`` and ``fit``, so one-time work shows as fractions of a call.
    """
    import torch

    torch.set_num_threads(1)
    stats, done = _profiled(framework, width, steps, spe, loader)
    base, base_done = _profiled("plain", width, steps, spe, loader)
    entries = stats.stats  # type: ignore[attr-defined]
    plain = base.stats  # type: ignore[attr-defined]
    print(
        f"{framework}, width {width}, {loader} loader: {done} steps under cProfile (it "
        "inflates Python-level costs: compare call counts and relative times)"
    )
    print(f"{'calls/step':>10}  {'own us/step':>11}  {'cum us/step':>11}  function")
    ranked = sorted(entries.items(), key=lambda item: item[1][2], reverse=True)
    for key, (_, calls, own, cum, _) in ranked[:top]:
        print(
            f"{calls / done:10.2f}  {own / done * 1e6:11.2f}  {cum / done * 1e6:11.2f}  "
            f"{_where(key)}"
        )
    print(f"\ncalls per step beyond the plain loop's ({base_done} steps), 0.01 a step or more:")
    print(f"{'extra/step':>10}  {'own us/step':>11}  {'cum us/step':>11}  function")
    extra = []
    for key, (_, calls, own, cum, _) in entries.items():
        more = calls / done - (plain[key][1] / base_done if key in plain else 0.0)
        if more >= 0.01:
            extra.append((own / done, more, cum / done, key))
    extra.sort(reverse=True)
    for own, more, cum, key in extra[:top]:
        print(f"{more:10.2f}  {own * 1e6:11.2f}  {cum * 1e6:11.2f}  {_where(key)}")
    total = sum(own for own, more, _, _ in extra if more >= 0.5)
    print(
        "own time of the functions called half a time a step or more beyond plain: "
        f"{total * 1e6:.1f} us/step under cProfile"
    )


# -- main --------------------------------------------------------------------------------------


def bootstrap(ratios: list[float], draws: int = 4000) -> tuple[float, float]:
    """A 95% interval for the median of ``ratios`` (percentile bootstrap, fixed seed)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def pool(paths: list[str]) -> None:
    """``--pool``: the per-round ratios to plain of several ``--json`` runs, together."""
    ratios: dict[tuple[str, str, str], list[float]] = {}
    for path in paths:
        with open(path) as f:
            runs = json.load(f)["runs"]
        plain = {(r["model"], r["round"]): r for r in runs if r["framework"] == "plain"}
        for run in runs:
            base = plain.get((run["model"], run["round"]))
            if run["framework"] == "plain" or base is None:
                continue
            for key in TIMINGS:
                if run[key] is not None and base[key]:
                    ratios.setdefault((run["model"], run["framework"], key), []).append(
                        run[key] / base[key]
                    )
    print(f"{len(paths)} runs pooled: medians of per-round ratios to plain [95% bootstrap]")
    for (model, framework, key), values in ratios.items():
        low, high = bootstrap(values)
        target = f"target {TIME_TARGETS[model]:.2f}" if framework == "cardcage" else ""
        print(
            f"  {model:<5} {framework:<12} {key:<18} {len(values):>4} rounds  "
            f"{statistics.median(values):.3f} [{low:.3f}-{high:.3f}]  {target}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="cardcage's per-step overhead and peak RSS against a plain PyTorch loop "
        "(and Lightning, Fabric and Accelerate, when installed). See the module docstring."
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="3 rounds of 600 steps: a smoke run, too noisy to judge",
    )
    parser.add_argument("--rounds", type=int, help="rounds (default 9; --quick 3)")
    parser.add_argument("--steps", type=int, help="steps per run (default 2000; --quick 600)")
    parser.add_argument("--epochs", type=int, help="epochs the steps span (default 8; --quick 6)")
    parser.add_argument(
        "--loader",
        choices=["default", "batched"],
        default="default",
        help="default: DataLoader(batch_size=64); batched: one index operation per batch",
    )
    parser.add_argument(
        "--gc",
        choices=["freeze", "default"],
        default="freeze",
        help="freeze (default): gc.freeze() after setup in every variant, so that full "
        "collections of torch's import heap do not land at random in the timed window; "
        "default: leave the collector alone",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the round orders")
    parser.add_argument("--no-lightning", action="store_true", help="leave Lightning's Trainer out")
    parser.add_argument(
        "--own-loop",
        action="store_true",
        help="only the own-loop variants: plain, cage, and fabric and accelerate where "
        "installed (no Trainer)",
    )
    parser.add_argument(
        "--step-checkpoints",
        type=int,
        metavar="N",
        help="add cardcage-ckpt-N: cardcage with checkpoint_every_n_steps=N (the restart "
        "default is 100), to measure what step checkpoints cost",
    )
    parser.add_argument("--json", metavar="PATH", help="also write every run and the summary")
    parser.add_argument(
        "--control", action="store_true", help="add plain.again: the plain loop twice a round"
    )
    parser.add_argument(
        "--pool", nargs="+", metavar="JSON", help="instead: pool the rounds of these --json files"
    )
    parser.add_argument(
        "--profile",
        metavar="VARIANT",
        choices=["cardcage", "lightning", *OWN_LOOPS],
        help="instead: profile VARIANT and the plain loop in this process, and list the "
        "calls per step VARIANT makes beyond plain",
    )
    parser.add_argument(
        "--paired",
        type=int,
        metavar="PAIRS",
        help="instead: per round and model, one process alternating PAIRS epochs of the plain "
        "loop and of cardcage, timed inside each epoch (the loop's own cost a step, with the "
        "host's drift cancelled)",
    )
    parser.add_argument("--width", type=int, default=32, help="hidden width for --profile")
    parser.add_argument("--top", type=int, default=30, help="functions --profile lists")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        spec = json.loads(args.child)
        result = paired_child(spec) if spec["framework"] == "paired" else child(spec)
        with open(args.child_out, "w") as f:
            json.dump(result, f)
        return 0
    if args.pool:
        pool(args.pool)
        return 0

    rounds = args.rounds or (3 if args.quick else 9)
    steps = args.steps or (600 if args.quick else 2000)
    epochs = args.epochs or (6 if args.quick else 8)
    if rounds < 1 or epochs < 3 or steps < epochs:
        parser.error("need --rounds >= 1, --epochs >= 3 and --steps >= --epochs")
    steps_per_epoch = steps // epochs
    steps = steps_per_epoch * epochs  # whole epochs: the steady window is whole epochs

    if args.paired:
        paired(rounds, args.paired, steps_per_epoch, args.loader, args.gc)
        return 0
    if args.profile:
        profile(args.profile, args.width, steps, steps_per_epoch, args.loader, args.top)
        return 0

    if args.own_loop and args.step_checkpoints:
        parser.error("--step-checkpoints measures the Trainer: not with --own-loop")
    frameworks = ["plain"] if args.own_loop else ["plain", "cardcage"]
    if args.control:
        frameworks.append("plain.again")
    if args.step_checkpoints:
        frameworks.append(f"cardcage-ckpt-{args.step_checkpoints}")
    lightning = None if args.no_lightning or args.own_loop else lightning_available()
    if lightning:
        frameworks.append("lightning")
    own = own_loop_available()
    frameworks += [name for name in OWN_LOOPS if own[name]]

    import importlib.metadata
    import platform

    torch_version = importlib.metadata.version("torch")  # the parent stays small: no torch
    cpus = os.cpu_count() or 1
    loads = [os.getloadavg()[0]]
    print(
        f"overhead: {rounds} rounds x {len(frameworks) * len(MODELS)} runs of {steps} steps "
        f"({epochs} epochs of {steps_per_epoch}, batch {BATCH}, {args.loader} loader, "
        f"gc {args.gc}), "
        f"1 torch thread; torch {torch_version}, python {platform.python_version()}, "
        f"{cpus} CPUs, load average {loads[0]:.2f}",
        flush=True,
    )
    print(f"  lightning: {lightning_note(lightning, args.own_loop, args.no_lightning)}")
    for name in OWN_LOOPS:
        print(f"  {name}: {own[name] or f'not importable here, skipped ({INSTALL[name]})'}")
    rng = random.Random(args.seed)
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cardcage-overhead-") as log_dir:
        for index in range(rounds):
            order = [(f, m) for f in frameworks for m in MODELS]
            rng.shuffle(order)
            for framework, model in order:
                spec = {
                    "framework": framework,
                    "model": model,
                    "width": MODELS[model],
                    "steps": steps,
                    "steps_per_epoch": steps_per_epoch,
                    "loader": args.loader,
                    "gc": args.gc,
                    "round": index,
                }
                try:
                    results.append(run_child(spec, log_dir))
                except (RuntimeError, subprocess.TimeoutExpired) as error:
                    print(f"error: {error}", file=sys.stderr)
                    return 1
            loads.append(os.getloadavg()[0])
            print(
                f"  round {index + 1}/{rounds} done ({time.perf_counter() - started:.0f} s, "
                f"load average {loads[-1]:.2f})",
                flush=True,
            )

    rows = summarise(results, frameworks)
    print()
    print_table(rows)
    print()
    for row in rows:
        collected = (
            f"{row['gc_all']:.0f} garbage collections during fit, {row['gc_full']:.0f} full, "
            f"{row['gc_ms']:.0f} ms (medians)"
        )
        if row["framework"] == "plain":
            print(f"  plain/{row['model']}: {collected}")
            continue
        notes = ["same weights as plain" if row["same_weights"] else "WEIGHTS DIFFER from plain"]
        if not row["steps_ok"]:
            notes.append("DID NOT RUN the asked number of steps")
        has_bar = row["framework"] not in ("plain.again", *OWN_LOOPS)
        if not row["log_bytes"] and has_bar:
            notes.append("its progress bar wrote nothing")
        print(
            f"  {row['framework']}/{row['model']}: {', '.join(notes)}; bar output "
            f"{row['log_bytes'] / 1024:.0f} KiB; import and build {row['setup_s']:.2f} s; "
            f"{collected}"
        )
    if max(loads) > cpus:
        print(
            f"\nnote: the load average reached {max(loads):.1f} on {cpus} CPUs: other processes "
            "competed for them, so the wall-clock ratios are noisy; read the quartiles and the "
            "CPU ratios."
        )
    misses = [r for r in rows if r["verdict"] and "MISS" in r["verdict"]]
    print(
        f"\ncardcage targets: {'all met' if not misses else f'missed in {len(misses)} row(s)'} "
        "(a miss is a finding, not an error)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "rounds": rounds,
                    "steps": steps,
                    "epochs": epochs,
                    "loader": args.loader,
                    "load_averages": loads,
                    "skipped": [name for name in OWN_LOOPS if not own[name]],
                    "runs": results,
                    "summary": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
