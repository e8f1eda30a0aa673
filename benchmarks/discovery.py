"""What plugin discovery costs: ``import cardcage; cardcage.select()`` over ``import torch``.

Every sample is a fresh Python process that imports torch, then cardcage, then selects with
default flags, timing each step with ``time.perf_counter`` inside the process; the parent also
times the whole process (wall time). Variants:

- ``torch``: ``import torch`` alone (the baseline for wall time).
- ``torch +200 path``: the same with the 200 synthetic distributions on ``PYTHONPATH``.
- ``shipped plugins``: the environment as installed (the nine shipped backends).
- ``+200 plugins``: the same plus 200 synthetic plugin distributions (dist-info folders and
  one module each, written straight into a temporary directory on ``PYTHONPATH``), each
  registering one backend with one rule (orders 700..899, never claiming, so every rule is
  evaluated before the CPU fallback decides).

Rounds are interleaved: each round runs every variant once, in random order, so drift in the
machine's load spreads over all variants alike. Medians are reported. Besides wall time the
child reports the CPU time of ``import cardcage; select()`` (``time.process_time``; far less
sensitive to other work on the machine) and the part of the wall time spent in garbage
collections: loading hundreds of plugin modules allocates enough to trigger a full collection,
which walks the whole heap torch left behind. Modules load from cached bytecode, as they do once
installed (a warm-up run writes it); ``--no-bytecode`` keeps ``PYTHONDONTWRITEBYTECODE``.

Targets: at most 60 ms (shipped plugins) and 150 ms (+200 plugins) over plain ``import torch``.
Missing a target is reported, not an error; the exit status is non-zero only when a sample
fails.

    python benchmarks/discovery.py [--rounds 15] [--plugins 200] [--no-bytecode] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

SETTINGS = (
    "CARDCAGE_DISABLE_PLUGINS",
    "CARDCAGE_PLUGINS_AUTOLOAD",
    "CARDCAGE_PLUGINS",
    "CARDCAGE_STRICT_PLUGINS",
)
TARGETS_MS = {"shipped plugins": 60.0, "+200 plugins": 150.0}  # over plain ``import torch``

CHILD = textwrap.dedent(
    """\
    import gc, os, sys, time
    gc_time = [0.0, 0.0]  # seconds spent in collections, and when the current one started

    def gc_clock(phase, info):
        if phase == "start":
            gc_time[1] = time.perf_counter()
        else:
            gc_time[0] += time.perf_counter() - gc_time[1]

    t0 = time.perf_counter()
    import torch
    t1 = time.perf_counter()
    result = {"torch": t1 - t0}
    if sys.argv[1] == "cardcage":
        gc.callbacks.append(gc_clock)
        c1 = time.process_time()
        import cardcage
        t2 = time.perf_counter()
        selection = cardcage.select()
        t3 = time.perf_counter()
        c3 = time.process_time()
        gc.callbacks.remove(gc_clock)
        from cardcage.plugins import manager as plugins
        registry = plugins.registry(os.environ)
        result.update(
            import_cardcage=t2 - t1,
            select=t3 - t2,
            cardcage=t3 - t1,
            cardcage_cpu=c3 - c1,
            gc=gc_time[0],
            accelerator=selection.accelerator,
            backends=len(registry.accelerators),
            failed=[r.name for r in registry.plugins if r.status == "failed"],
        )
    import json
    print(json.dumps(result))
    """
)

SYNTHETIC = textwrap.dedent(
    '''\
    """Synthetic cardcage plugin {index} (benchmarks/discovery.py)."""

    import cardcage
    from cardcage import Accelerator, Availability, Rule


    class Synthetic{index:03d}(Accelerator):
        name = "synth_{index:03d}"
        aliases = ("synthetic_{index:03d}",)
        rules = (
            Rule(
                order={order},
                when=lambda ctx: ctx.env.get("SYNTH_{index:03d}") == "1",
                why="SYNTH_{index:03d} is set",
            ),
        )

        @classmethod
        def availability(cls, ctx):
            return Availability(True)


    @cardcage.hookimpl
    def cardcage_accelerators():
        return [Synthetic{index:03d}]
    '''
)


def write_synthetic(root: Path, count: int) -> None:
    """``count`` installed-looking plugin distributions: a module and a dist-info each."""
    for index in range(count):
        module = f"cardcage_synth_{index:03d}"
        (root / f"{module}.py").write_text(SYNTHETIC.format(index=index, order=700 + index))
        info = root / f"cardcage_synth_{index:03d}-0.1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: cardcage-synth-{index:03d}\nVersion: 0.1.0\n"
        )
        (info / "entry_points.txt").write_text(f"[cardcage]\nsynth_{index:03d} = {module}\n")
        (info / "top_level.txt").write_text(module + "\n")


@dataclass
class Variant:
    name: str
    mode: str  # torch | cardcage
    path: str | None  # PYTHONPATH
    samples: list[dict[str, object]] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)


def child_env(path: str | None, bytecode: bool) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in SETTINGS}
    env.pop("PYTHONPATH", None)
    if bytecode:
        # as installed: modules load from cached bytecode (written by the warm-up run)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    if path:
        env["PYTHONPATH"] = path
    return env


def sample(variant: Variant, bytecode: bool) -> None:
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", CHILD, variant.mode],
        env=child_env(variant.path, bytecode),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{variant.name}: the child failed:\n{result.stderr}")
    variant.samples.append(json.loads(result.stdout))
    variant.walls.append(wall)


def median(values: list[float]) -> float:
    return statistics.median(values)


def summarize(
    variants: list[Variant], baselines: dict[str, Variant], plugins: int
) -> tuple[list[dict[str, object]], list[str]]:
    """Median rows, and the errors found in the samples."""
    errors: list[str] = []
    backends: dict[str, int | None] = {}
    for variant in variants:
        if variant.mode != "cardcage":
            continue
        accelerators = {str(s["accelerator"]) for s in variant.samples}
        failed = {str(name) for s in variant.samples for name in s["failed"]}  # type: ignore[attr-defined]
        counts = {int(s["backends"]) for s in variant.samples}  # type: ignore[call-overload]
        backends[variant.name] = counts.pop() if len(counts) == 1 else None
        if failed:
            errors.append(f"{variant.name}: plugins failed to load: {sorted(failed)}")
        if len(accelerators) != 1:
            errors.append(f"{variant.name}: selections differ between runs: {accelerators}")
    few, many = backends.get("shipped plugins"), backends.get(f"+{plugins} plugins")
    if few is not None and many is not None and many - few != plugins:
        errors.append(f"{many} backends registered with the synthetic plugins, not {few}+{plugins}")

    rows: list[dict[str, object]] = []
    for variant in variants:
        row: dict[str, object] = {
            "variant": variant.name,
            "samples": len(variant.samples),
            "import_torch_ms": 1000 * median([float(s["torch"]) for s in variant.samples]),  # type: ignore[arg-type]
            "wall_ms": 1000 * median(variant.walls),
        }
        if variant.mode == "cardcage":
            for key in ("import_cardcage", "select", "cardcage", "cardcage_cpu", "gc"):
                values = [float(s[key]) for s in variant.samples]  # type: ignore[arg-type]
                row[f"{key}_ms"] = 1000 * median(values)
            base = baselines[variant.name]
            deltas = [w - b for w, b in zip(variant.walls, base.walls, strict=True)]
            row["wall_over_torch_ms"] = 1000 * median(deltas)
            row["backends"] = backends[variant.name]
            target = TARGETS_MS["shipped plugins" if variant.path is None else "+200 plugins"]
            row["target_ms"] = target
            row["met"] = float(row["cardcage_ms"]) <= target  # type: ignore[arg-type]
            row["met_cpu"] = float(row["cardcage_cpu_ms"]) <= target  # type: ignore[arg-type]
        rows.append(row)
    return rows, errors


def print_table(rows: list[dict[str, object]], title: str) -> None:
    print(title)
    header = (
        f"{'variant':<18} {'import torch':>12} {'import cc':>9} {'select':>8} {'cc total':>8} "
        f"{'(gc)':>7} {'cc cpu':>7} {'wall':>8} {'wall-torch':>10} {'target':>7}  met (wall/cpu)"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        line = f"{row['variant']:<18} {row['import_torch_ms']:12.1f} "
        if "cardcage_ms" not in row:
            print(line + f"{'':>9} {'':>8} {'':>8} {'':>7} {'':>7} {row['wall_ms']:8.1f}")
            continue
        print(
            line + f"{row['import_cardcage_ms']:9.1f} {row['select_ms']:8.1f} "
            f"{row['cardcage_ms']:8.1f} {row['gc_ms']:7.1f} {row['cardcage_cpu_ms']:7.1f} "
            f"{row['wall_ms']:8.1f} "
            f"{row['wall_over_torch_ms']:10.1f} {row['target_ms']:7.0f}  "
            f"{'yes' if row['met'] else 'NO'}/{'yes' if row['met_cpu'] else 'NO'}"
        )
    print(
        "ms, medians. 'cc total' = import cardcage + select(), timed in the child after "
        "import torch\n(the cost over torch; 'met' compares it with the target); '(gc)' = "
        "the part of it spent in\ngarbage collections (a full one walks torch's heap); 'cc "
        "cpu' = the CPU time of 'cc total'\n(less sensitive to a loaded machine); "
        "'wall-torch' = process wall time over the torch-only\nrun of the same round and "
        "PYTHONPATH."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--plugins", type=int, default=200, help="synthetic distributions")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--no-bytecode",
        action="store_true",
        help="keep PYTHONDONTWRITEBYTECODE from the environment (compile every module anew)",
    )
    parser.add_argument("--json", action="store_true", help="print the medians as JSON")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    bytecode = not args.no_bytecode

    with tempfile.TemporaryDirectory(prefix="cardcage-bench-") as tmp:
        started = time.perf_counter()
        write_synthetic(Path(tmp), args.plugins)
        generation = time.perf_counter() - started
        variants = [
            Variant("torch", "torch", None),
            Variant(f"torch +{args.plugins} path", "torch", tmp),
            Variant("shipped plugins", "cardcage", None),
            Variant(f"+{args.plugins} plugins", "cardcage", tmp),
        ]
        baselines = {variants[2].name: variants[0], variants[3].name: variants[1]}
        try:
            for variant in variants:  # warm the page cache and the .pyc files; not counted
                sample(variant, bytecode)
                variant.samples.clear()
                variant.walls.clear()
            for round_index in range(args.rounds):
                for variant in rng.sample(variants, len(variants)):
                    sample(variant, bytecode)
                print(f"round {round_index + 1}/{args.rounds}", end="\r", file=sys.stderr)
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            print(f"discovery benchmark: {error}", file=sys.stderr)
            return 1
    print(file=sys.stderr)

    rows, errors = summarize(variants, baselines, args.plugins)
    if args.json:
        print(json.dumps({"rounds": args.rounds, "rows": rows, "errors": errors}, indent=2))
    else:
        print_table(
            rows,
            f"cardcage discovery cost: {args.rounds} interleaved rounds of fresh processes, "
            f"python {sys.version.split()[0]}, bytecode {'cached' if bytecode else 'off'}, "
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} "
            f"({args.plugins} synthetic dists written in {generation * 1000:.0f} ms)",
        )
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
