"""Hyperparameter grids: values from the command line (``--grid lr=1e-3,1e-2``), the
expansion into one point per combination, and the names of the points' folders."""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence

from cardcage.sdk import FLAG_NAMES, MisconfigurationError

Value = bool | int | float | str


def parse_value(text: str) -> Value:
    """A grid value from the command line: ``"16"`` → 16, ``"1e-3"`` → 0.001, else the text."""
    stripped = text.strip()
    for kind in (int, float):
        try:
            return kind(stripped)  # type: ignore[no-any-return]
        except ValueError:
            pass
    return stripped


def parse_grid_option(text: str) -> tuple[str, list[Value]]:
    """``"lr=1e-3,1e-2"`` → ``("lr", [0.001, 0.01])`` (the ``--grid`` option)."""
    name, equals, values = text.partition("=")
    name = name.strip()
    if not equals or not name:
        raise MisconfigurationError(
            f"--grid {text!r} is not NAME=VALUES. Write it like --grid lr=1e-3,1e-2 (one "
            "--grid per hyperparameter)."
        )
    pieces = [piece for piece in values.split(",") if piece.strip()]
    if not pieces:
        raise MisconfigurationError(
            f"--grid {text!r} gives no value for {name!r}. List them after '=', separated by "
            "commas: --grid lr=1e-3,1e-2."
        )
    return name, [parse_value(piece) for piece in pieces]


def _check_name(name: object, source: str) -> str:
    if not isinstance(name, str) or not name.isidentifier():
        raise MisconfigurationError(
            f"{source}: hyperparameter name {name!r} is not a Python identifier. Use names "
            "like lr or num_layers (they become keyword arguments, or --NAME options of a "
            "script)."
        )
    if name in FLAG_NAMES:
        raise MisconfigurationError(
            f"{source}: {name!r} is a Trainer flag, not a hyperparameter: a grid over it would "
            f"change the job's layout. Set it once (trainer={{{name!r}: ...}}, or --"
            f"{name.replace('_', '-')} on the command line) and submit one grid per value."
        )
    return name


def expand_grid(
    grid: Mapping[str, Sequence[Value] | Value] | Sequence[Mapping[str, Value]] | None,
) -> list[dict[str, Value]]:
    """Every combination, the first hyperparameter varying slowest (the seed's order).

    ``{"lr": [1e-3, 1e-2], "layers": [16, 32]}`` gives ``lr=1e-3, layers=16``, then
    ``layers=32``, then ``lr=1e-2`` with each. A scalar is a one-value list. A sequence of
    mappings is taken as the points themselves. ``None`` or ``{}``: one point, no
    hyperparameters.
    """
    if grid is None:
        return [{}]
    if isinstance(grid, Mapping):
        names: list[str] = []
        columns: list[list[Value]] = []
        for name, values in grid.items():
            names.append(_check_name(name, "grid"))
            listed = (
                list(values)
                if isinstance(values, Sequence) and not isinstance(values, str)
                else [values]
            )
            if not listed:
                raise MisconfigurationError(
                    f"grid {name}=[] has no value. Give at least one value, or leave {name} "
                    "out of the grid."
                )
            for value in listed:
                _check_value(name, value)
            seen: list[Value] = []
            for value in listed:
                if value in seen:
                    raise MisconfigurationError(
                        f"grid {name}={listed!r} lists {value!r} twice, which would submit the "
                        "same job twice. List each value once."
                    )
                seen.append(value)
            columns.append(listed)
        return [
            dict(zip(names, combination, strict=True))
            for combination in itertools.product(*columns)
        ]
    points: list[dict[str, Value]] = []
    for point in grid:
        if not isinstance(point, Mapping):
            raise MisconfigurationError(
                f"grid point {point!r} is not a mapping. Pass a mapping of lists "
                "({'lr': [1e-3, 1e-2]}) or a list of mappings ([{'lr': 1e-3}, ...])."
            )
        for name, value in point.items():
            _check_name(name, "grid")
            _check_value(name, value)
        points.append(dict(point))
    if not points:
        raise MisconfigurationError("grid=[] has no point. Pass at least one, or grid=None.")
    return points


def _check_value(name: str, value: object) -> None:
    if not isinstance(value, (bool, int, float, str)):
        raise MisconfigurationError(
            f"grid {name}={value!r} is a {type(value).__name__}: hyperparameters are recorded "
            "in hparams.json and passed to scripts as --NAME=VALUE, so they must be numbers, "
            "strings or booleans."
        )


def _slug(value: Value) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]", "_", str(value))[:40]


def _point_folder_name(index: int, hparams: Mapping[str, Value]) -> str:
    parts = [f"{index:03d}", *(f"{name}={_slug(value)}" for name, value in hparams.items())]
    return "-".join(parts)[:120]


def _describe(hparams: Mapping[str, Value]) -> str:
    return " ".join(f"{name}={value}" for name, value in hparams.items()) or "(no hyperparameters)"
