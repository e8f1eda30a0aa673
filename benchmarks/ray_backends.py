"""Two Ray nodes on one machine: cardcage's ray backend against Ray Train, plain actors, torchrun.

Usage::

    python benchmarks/ray_backends.py              # 5 rounds x 4 epochs x 150 steps per variant
    python benchmarks/ray_backends.py --quick      # 2 rounds x 3 epochs x 40 steps: a smoke run
    python benchmarks/ray_backends.py --rounds 3 --json ray.json
    python benchmarks/ray_backends.py --health-check-interval 2   # Ray Train's own default

The benchmark starts a two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``,
``num_cpus=1`` and a 100 MiB object store per node, no dashboard, every node on 127.0.0.1),
keeps it for the whole run, and points every run at it through ``RAY_ADDRESS``. Variants,
each training ddp.py's module on ddp.py's data (an MLP, SGD with momentum, batch 64 per
rank, a ``DistributedSampler`` without shuffling) in two CPU ranks over gloo, with
``OMP_NUM_THREADS=1`` everywhere (the cluster's processes inherit it):

* ``torchrun``: ddp.py's plain PyTorch DDP script, launched by ``torchrun --standalone
  --nproc-per-node=2`` (no Ray);
* ``cardcage-ray``: ``python ray_backends.py`` calling ``cardcage.Trainer(distributed_backend="ray",
  num_nodes=2, logger=False, progress_bar=False).fit(model)``: one rank as a Ray actor on
  each node, rank 0's weights handed back to the script;
* ``ray-train``: ``python ray_backends.py`` calling Ray Train's ``TorchTrainer`` with
  ``ScalingConfig(num_workers=2, use_gpu=False)``, a fresh ``RunConfig(name=...,
  storage_path=...)`` per run (a reused name resumes the old run); its loop is plain DDP
  written as Ray Train's docs show (``prepare_model``, ``prepare_data_loader``,
  ``ray.train.report`` of the loss at each epoch's end). ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``
  (``--health-check-interval``, default 0.2 s; Ray's own default is 2 s) is how often its
  controller polls the workers; a report waits until the previous one was read;
* ``ray-actors``: the control, ``torchrun``'s loop (ddp.py's ``plain_worker``) in two plain Ray
  actors that ``python ray_backends.py`` starts itself (a ``STRICT_SPREAD`` placement group
  of two ``{"CPU": 1}`` bundles, ``num_cpus=1`` each, the rendezvous variables set as
  cardcage's launcher sets them; no cardcage): what training inside Ray's worker processes
  costs by itself, so that ``cardcage-ray`` against it is cardcage's own part.

Timings, as ddp.py takes them (its ``measure``):

* ``wall``: the whole command from its start to its exit: interpreter, imports, joining the
  cluster, starting the ranks, the rendezvous, training, teardown (not starting the cluster);
* ``step``: the steady-state time per step inside rank 0, from the first step of the second
  epoch to the last step;
* ``fixed``: ``wall - steps x step``, what the run costs beyond its steps.

Each round runs every variant once, in a shuffled order (``--seed``), so that load from
other processes falls on all of them alike. Ratios are medians over rounds of the per-round
ratio, with the quartiles: against ``torchrun``, and ``cardcage-ray`` against ``ray-train``
and ``ray-actors``. ``max|dw|`` is the largest difference of the final weights from
``torchrun``'s of the same round. Nothing is judged: there are no targets, and the exit
status is non-zero only when a run fails.
"""

from __future__ import annotations

import os
import sys

# Every Ray node on 127.0.0.1 (read when ray is first imported; see the research notes).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import argparse
import json
import random
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import ddp

VARIANTS = ("torchrun", "cardcage-ray", "ray-train", "ray-actors")
#: (variant, baseline) pairs of the table.
PAIRS = (
    ("cardcage-ray", "torchrun"),
    ("ray-train", "torchrun"),
    ("ray-actors", "torchrun"),
    ("cardcage-ray", "ray-train"),
    ("cardcage-ray", "ray-actors"),
)


def command_for(variant: str, spec: dict[str, Any]) -> list[str]:
    """The command of a variant: ddp.py's for torchrun, this script's for the Ray ones."""
    if variant == "torchrun":
        return ddp.command_for(variant, spec)
    return [
        sys.executable,
        os.path.abspath(__file__),
        "--variant",
        variant,
        "--spec",
        json.dumps(spec),
    ]


# -- the variants, each a command of its own ---------------------------------------------------


def ray_train_loop(spec: dict[str, Any]) -> None:
    """Each Ray Train worker: plain DDP as Ray Train's docs write it."""
    import ddp
    import ray.train
    import ray.train.torch
    import torch
    from torch.nn import functional as F

    model = ddp.Model(spec)
    parallel = ray.train.torch.prepare_model(model)  # DistributedDataParallel on the CPU
    loader = ray.train.torch.prepare_data_loader(  # adds the DistributedSampler
        torch.utils.data.DataLoader(ddp.dataset(spec), batch_size=ddp.BATCH, shuffle=False)
    )
    optimizer = model.configure_optimizers()
    model.train()
    for epoch in range(spec["epochs"]):
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for batch_idx, (x, y) in enumerate(loader):
            model.mark(batch_idx)
            optimizer.zero_grad()
            loss = F.cross_entropy(parallel(x), y)
            loss.backward()
            optimizer.step()
        ray.train.report({"epoch": epoch, "loss": loss.item()})
    ddp.record_marks(spec["out"], model.marks, model.steps)
    if ray.train.get_context().get_world_rank() == 0:
        ddp.save_weights(spec["out"], model)


class PlainRank:
    """One rank of ddp.py's plain DDP loop, as a Ray actor (``ray.remote`` makes the class)."""

    def node_ip(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]

    def free_port(self) -> int:
        with socket.socket() as sock:
            sock.bind(("", 0))
            return int(sock.getsockname()[1])

    def train(self, env: dict[str, str], spec: dict[str, Any]) -> None:
        import ddp

        os.environ.update(env)
        ddp.plain_worker(int(env["RANK"]), spec)


def ray_actors(spec: dict[str, Any]) -> None:
    """ddp.py's plain loop in two plain Ray actors, one on each node: no cardcage, no Ray Train."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
    group = placement_group([{"CPU": 1}] * ddp.WORLD, strategy="STRICT_SPREAD")
    remote: Any = ray.remote(PlainRank)
    actors: list[Any] = []
    try:
        ray.get(group.ready(), timeout=60)
        # In the process's environment from its start: unpickling the class imports torch.
        threads = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        for rank in range(ddp.WORLD):
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
            actors.append(
                remote.options(
                    scheduling_strategy=strategy,
                    num_cpus=1,
                    runtime_env={"env_vars": threads},
                ).remote()
            )
        address: str = ray.get(actors[0].node_ip.remote(), timeout=60)
        port = ray.get(actors[0].free_port.remote(), timeout=60)
        common = {"MASTER_ADDR": address, "MASTER_PORT": str(port), "WORLD_SIZE": str(ddp.WORLD)}
        if address.startswith("127."):
            common["GLOO_SOCKET_IFNAME"] = "lo"  # the nodes of one machine meet on loopback
        ray.get(
            [
                actor.train.remote({**common, "RANK": str(rank), "LOCAL_RANK": "0"}, spec)
                for rank, actor in enumerate(actors)
            ]
        )
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(group)
        ray.shutdown()


def run_variant(variant: str, spec: dict[str, Any]) -> None:
    """Body of ``ray_backends.py --variant VARIANT``, run with ``RAY_ADDRESS`` naming the
    cluster."""
    if variant == "cardcage-ray":
        import cardcage

        model = ddp.Model(spec)
        trainer = cardcage.Trainer(
            distributed_backend="ray",
            num_nodes=ddp.WORLD,
            max_epochs=spec["epochs"],
            logger=False,
            progress_bar=False,
        )
        trainer.fit(model)
        ddp.save_weights(spec["out"], model)  # rank 0's trained state, handed back
        return
    if variant == "ray-train":
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        trainer = TorchTrainer(
            ray_train_loop,
            train_loop_config=spec,
            scaling_config=ScalingConfig(num_workers=ddp.WORLD, use_gpu=False),
            run_config=RunConfig(
                name=f"ray-train-{spec['round']}", storage_path=str(Path(spec["out"], "runs"))
            ),
        )
        trainer.fit()
        return
    if variant == "ray-actors":
        ray_actors(spec)
        return
    raise SystemExit(f"unknown variant {variant!r}")


# -- the parent: the cluster, rounds, the table -------------------------------------------------


def start_cluster() -> tuple[Any, str]:
    """Two Ray nodes of one CPU each on this machine; the cluster and its temporary folder."""
    folder = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Unix socket paths stay short
    os.environ["RAY_TMPDIR"] = folder
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "object_store_memory": 100 << 20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    cluster.add_node(**node)
    cluster.wait_for_nodes()
    return cluster, folder


def summarise(rounds: list[dict[str, dict[str, Any]]], steps: int) -> list[dict[str, Any]]:
    for runs in rounds:
        for run in runs.values():
            run["fixed_s"] = run["wall_s"] - steps * run["step_s"]
            run["max_dw"] = ddp.max_difference(run["weights"], runs["torchrun"]["weights"])
    rows = []
    for variant, baseline in [("torchrun", None), *PAIRS]:
        runs = [r[variant] for r in rounds]
        row: dict[str, Any] = {"variant": variant, "baseline": baseline}
        for key in ("wall_s", "step_s", "fixed_s"):
            row[key] = statistics.median(r[key] for r in runs)
            if baseline is not None:
                ratios = [r[variant][key] / r[baseline][key] for r in rounds]
                row[key.removesuffix("_s") + "_ratio"] = ddp.quartiles(ratios)
        row["max_dw"] = max(r["max_dw"] for r in runs)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    header = (
        f"{'variant':<13} {'vs':<10} {'wall s':>7} {'wall ratio [q1, q3]':>22} {'step ms':>8} "
        f"{'step ratio [q1, q3]':>22} {'fixed s':>8} {'fixed ratio [q1, q3]':>22} "
        f"{'max|dw|':>8}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        first = row["baseline"] in (None, "torchrun")  # the variant's own figures, once
        lines.append(
            f"{row['variant']:<13} {row['baseline'] or '-':<10} "
            + (f"{row['wall_s']:>7.2f} " if first else f"{'':>7} ")
            + f"{ddp._ratio(row, 'wall_ratio'):>22} "
            + (f"{row['step_s'] * 1e3:>8.3f} " if first else f"{'':>8} ")
            + f"{ddp._ratio(row, 'step_ratio'):>22} "
            + (f"{row['fixed_s']:>8.2f} " if first else f"{'':>8} ")
            + f"{ddp._ratio(row, 'fixed_ratio'):>22} "
            + (f"{row['max_dw']:>8.1e}" if first else "")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds x 3 epochs x 40 steps")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=None, help="at least 3")
    parser.add_argument("--steps-per-epoch", type=int, default=None)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0, help="order of the variants")
    parser.add_argument(
        "--health-check-interval",
        type=float,
        default=0.2,
        help="RAY_TRAIN_HEALTH_CHECK_INTERVAL_S for Ray Train (Ray's default: 2)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the rows here too")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.variant:
        run_variant(args.variant, json.loads(args.spec))
        return 0

    import ray

    rounds = args.rounds or (2 if args.quick else 5)
    epochs = max(args.epochs or (3 if args.quick else 4), 3)
    steps_per_epoch = args.steps_per_epoch or (40 if args.quick else 150)
    steps = epochs * steps_per_epoch
    # Read by the cluster's processes (started below) and by every run.
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(args.health_check_interval)
    print(
        f"ray benchmark: 2 Ray nodes of 1 CPU on this machine ({os.cpu_count()} CPUs), ray "
        f"{ray.__version__}; {ddp.WORLD} ranks (gloo, OMP_NUM_THREADS=1), MLP width "
        f"{args.width}, batch {ddp.BATCH} per rank, {epochs} epochs x {steps_per_epoch} steps, "
        f"{rounds} rounds; RAY_TRAIN_HEALTH_CHECK_INTERVAL_S={args.health_check_interval}",
        flush=True,
    )
    work = Path(tempfile.mkdtemp(prefix="cardcage-ray-bench-"))
    start = time.perf_counter()
    cluster, ray_folder = start_cluster()
    os.environ["RAY_ADDRESS"] = cluster.address
    print(f"  cluster at {cluster.address} up in {time.perf_counter() - start:.1f} s", flush=True)
    order = random.Random(args.seed)
    results: list[dict[str, dict[str, Any]]] = []
    loads = []
    try:
        for index in range(rounds):
            shuffled = list(VARIANTS)
            order.shuffle(shuffled)
            current = {}
            for variant in shuffled:
                spec = {
                    "round": index,
                    "epochs": epochs,
                    "steps_per_epoch": steps_per_epoch,
                    "width": args.width,
                    "out": str(work / variant / str(index)),
                }
                current[variant] = ddp.measure(variant, spec, work, command_for)
                loads.append(os.getloadavg()[0])
                print(
                    f"  round {index + 1}/{rounds} {variant:<13} wall "
                    f"{current[variant]['wall_s']:6.2f} s  step "
                    f"{current[variant]['step_s'] * 1e3:7.3f} ms"
                    + ("  (aborted at exit)" if current[variant]["aborted_at_exit"] else ""),
                    flush=True,
                )
            results.append(current)
    finally:
        cluster.shutdown()
        shutil.rmtree(ray_folder, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    rows = summarise(results, steps)
    print()
    print(table(rows))
    print(
        f"fixed = wall - {steps} steps x step; ratios: medians of per-round ratios [quartiles]; "
        "max|dw|: final weights against torchrun's of the same round"
    )
    ddp.print_notes(results, ["torchrun"], loads)
    if args.json:
        runs = [
            {v: {k: x for k, x in run.items() if k != "weights"} for v, run in r.items()}
            for r in results
        ]
        args.json.write_text(
            json.dumps(
                {
                    "rounds": rounds,
                    "epochs": epochs,
                    "steps_per_epoch": steps_per_epoch,
                    "width": args.width,
                    "ray": ray.__version__,
                    "health_check_interval_s": args.health_check_interval,
                    "max_load": max(loads),
                    "rows": rows,
                    "runs": runs,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
