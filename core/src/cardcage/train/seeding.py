"""``cardcage.seed_everything``: one seed for Python's, NumPy's and torch's generators.

As Lightning 1.0's ``seed_everything``: the seed is the argument, else ``PL_GLOBAL_SEED`` from
the environment, else a random one (with a warning that names it); it is written back to
``PL_GLOBAL_SEED`` so that a process started later (a relaunched rank runs the same script)
reads the same seed. Differences, on purpose: a seed outside ``[0, 2**32 - 1]`` or one that is
not an integer is refused (Lightning replaced it by a random one with a warning), and
``workers=True`` is refused until cardcage seeds dataloader workers itself.
"""

from __future__ import annotations

import os
import random
import warnings

import torch

from cardcage.errors import MisconfigurationError

#: The variable that carries the seed to later processes (Lightning's name).
SEED_VARIABLE = "PL_GLOBAL_SEED"
MIN_SEED, MAX_SEED = 0, 2**32 - 1


def _checked(seed: object, where: str) -> int:
    number: int | None = None
    if isinstance(seed, int) and not isinstance(seed, bool):
        number = seed
    elif isinstance(seed, str):
        try:
            number = int(seed.strip())
        except ValueError:
            number = None
    if number is None or not MIN_SEED <= number <= MAX_SEED:
        raise MisconfigurationError(
            f"{where}={seed!r} is not a seed: give an integer from {MIN_SEED} to {MAX_SEED}, "
            "or None to take PL_GLOBAL_SEED (or a random seed)."
        )
    return number


def seed_everything(seed: int | None = None, workers: bool = False) -> int:
    """Seed ``random``, NumPy (when installed) and torch (every device) with ``seed`` and
    return it; see the module docstring for where a missing seed comes from."""
    if workers:
        raise MisconfigurationError(
            "seed_everything(workers=True) is not supported yet: cardcage does not seed "
            "dataloader workers. Give your DataLoader a worker_init_fn (and a generator), or "
            "call seed_everything(seed) without workers."
        )
    if seed is None:
        found = os.environ.get(SEED_VARIABLE)
        if found is not None:
            seed = _checked(found, f"environment variable {SEED_VARIABLE}")
        else:
            seed = random.randint(MIN_SEED, MAX_SEED)
            warnings.warn(f"seed_everything: no seed given, seed set to {seed}", stacklevel=2)
    else:
        seed = _checked(seed, "seed")
    os.environ[SEED_VARIABLE] = str(seed)
    random.seed(seed)
    try:
        import numpy
    except ImportError:  # NumPy is optional for torch
        pass
    else:
        numpy.random.seed(seed)
    torch.manual_seed(seed)  # every device's generator, CUDA's included
    return seed
