"""The Trainer flags on a command line: spelled the same way by every ``cardcage`` command,
the core's and the ones plugins add (``add_trainer_flags`` then ``trainer_flags``).
"""

from __future__ import annotations

import argparse
from typing import Any


def _int_or_ids(value: str) -> int | str:
    """``"2"`` → 2 (a count), ``"1,3"`` or ``"3,"`` → the string (ids), as Lightning's CLI did."""
    text = value.strip()
    if "," in text:
        return text
    try:
        return int(text)
    except ValueError:
        return text  # validation names the flag and value


def _precision(value: str) -> int | str:
    return int(value) if value.isdigit() else value


def add_trainer_flags(parser: argparse.ArgumentParser) -> None:
    """The Trainer flags, spelled ``--gpus``, ``--tpu-cores``, ``--num-processes``...
    (``cardcage --help``)."""
    group = parser.add_argument_group("trainer flags")
    group.add_argument(
        "--gpus",
        type=_int_or_ids,
        default=None,
        help="GPU count (2), all (-1), or ids ('1,3' or '3,')",
    )
    group.add_argument(
        "--tpu-cores", type=_int_or_ids, default=None, help="1, 8, or one core as 'k,'"
    )
    group.add_argument("--num-processes", type=int, default=1)
    group.add_argument("--num-nodes", type=int, default=1)
    group.add_argument(
        "--distributed-backend",
        "--backend",
        dest="distributed_backend",
        default=None,
        help="a backend name or alias; default: the rules decide",
    )
    group.add_argument("--auto-select-gpus", action="store_true")
    group.add_argument("--precision", type=_precision, default=32, help="32, 16, 64 or bf16")
    group.add_argument("--max-epochs", type=int, default=None)
    group.add_argument("--max-steps", type=int, default=None)


def trainer_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The Trainer keyword arguments held by ``args``."""
    names = (
        "gpus",
        "tpu_cores",
        "num_processes",
        "num_nodes",
        "distributed_backend",
        "auto_select_gpus",
        "precision",
        "max_epochs",
        "max_steps",
    )
    return {name: getattr(args, name) for name in names}
