"""``hparams.yaml``: hyperparameters written as YAML without a YAML library.

Hyperparameters are plain data (numbers, strings, booleans, ``None``, lists and mappings of
them), so the core writes that subset of YAML itself rather than depend on PyYAML: block
mappings and sequences, ``null``/``true``/``false``, numbers as Python prints them (``.nan``,
``.inf``), strings plain when YAML reads them back as the same string and double-quoted
otherwise (JSON's escapes, which YAML shares, and ``\\uXXXX`` for what YAML does not take as
it is: DEL, the C1 controls, lone surrogates). Keys are written as strings: two keys that
would be written alike (``1`` and ``"1"``), or a value that holds itself, are refused by
name. A tuple or set is written as a list, an ``argparse.Namespace`` as its mapping, an
array or tensor as its ``tolist()``; any other value as its ``str()``. ``yaml.safe_load``
reads the file back as the values given.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

from cardcage.config.files import write_atomically, write_error
from cardcage.errors import MisconfigurationError

HPARAMS_FILE = "hparams.yaml"

# A string YAML reads back as itself when written plain: starts with a letter or underscore,
# holds no character YAML gives a meaning to, and is none of YAML 1.1's other words.
_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-/]*")
_RESERVED = {
    "y", "n", "yes", "no", "on", "off", "true", "false", "null", "nan", "inf",
}  # fmt: skip


def plain_data(value: Any, where: str = "", inside: frozenset[int] = frozenset()) -> Any:
    """``value`` as plain data: mappings, lists, and scalars YAML writes as they are.

    Keys become strings: two keys of one mapping that become the same string (``1`` and
    ``"1"``), or a mapping or list that holds itself, raise
    :class:`~cardcage.MisconfigurationError` naming the key (``where`` is the path so far)."""
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, Mapping | list | tuple | set | frozenset):
        if id(value) in inside:
            raise MisconfigurationError(
                f"hparams: {where or 'the hyperparameters'!r} holds itself (a recursive"
                f" {type(value).__name__}), which no file can hold. Fix: log a copy without"
                " the cycle, or leave that entry out of the hyperparameters."
            )
        inside = inside | {id(value)}
    if isinstance(value, Mapping):
        plain: dict[str, Any] = {}
        given: dict[str, Any] = {}
        for key, item in value.items():
            name = str(key)
            if name in given:
                place = f" in {where!r}" if where else ""
                raise MisconfigurationError(
                    f"hparams: the keys {given[name]!r} and {key!r}{place} are both written as"
                    f" {name!r} (keys are written as strings), so one would be lost. Fix:"
                    " rename one of them."
                )
            given[name] = key
            plain[name] = plain_data(item, f"{where}.{name}" if where else name, inside)
        return plain
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
        return [plain_data(item, f"{where}[{i}]", inside) for i, item in enumerate(items)]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if callable(getattr(value, "tolist", None)):  # numpy arrays and scalars, tensors
        return plain_data(value.tolist(), where, inside)
    return str(value)


# What YAML does not take as it is inside a double-quoted string, and JSON leaves alone:
# DEL and the C1 controls (NEL is a line break to YAML), the line and paragraph separators,
# surrogates (a lone one cannot be encoded), the byte-order mark and the non-characters.
_UNPRINTABLE = re.compile("[\x7f-\x9f\u2028\u2029\ud800-\udfff\ufeff\ufffe\uffff]")


def _quoted(text: str) -> str:
    """``text`` double-quoted, escaped so that YAML reads it back as ``text``."""
    quoted = json.dumps(text, ensure_ascii=False)
    return _UNPRINTABLE.sub(lambda found: f"\\u{ord(found[0]):04x}", quoted)


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan"
        if math.isinf(value):
            return ".inf" if value > 0 else "-.inf"
        text = repr(value)
        # YAML 1.1 (PyYAML) reads a float only with a dot: 1e-05 is written 1.0e-05.
        return text.replace("e", ".0e") if "." not in text else text
    text = str(value)
    if _PLAIN.fullmatch(text) and text.lower() not in _RESERVED:
        return text
    return _quoted(text)


def _lines(value: Any, indent: str) -> list[str]:
    """The block lines of a non-empty mapping or list, each starting with ``indent``."""
    lines: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            head = f"{indent}{_scalar(key)}:"
            if isinstance(item, dict | list) and item:
                lines.append(head)
                lines.extend(_lines(item, indent + "  "))
            else:
                lines.append(f"{head} {_inline(item)}")
        return lines
    for item in value:
        if isinstance(item, dict | list) and item:
            nested = _lines(item, indent + "  ")
            lines.append(f"{indent}- {nested[0][len(indent) + 2 :]}")
            lines.extend(nested[1:])
        else:
            lines.append(f"{indent}- {_inline(item)}")
    return lines


def _inline(value: Any) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return _scalar(value)


def to_yaml(params: Mapping[str, Any]) -> str:
    """``params`` as a YAML document (a block mapping; ``{}`` when empty)."""
    data = plain_data(params)
    if not data:
        return "{}\n"
    return "\n".join(_lines(data, "")) + "\n"


def write_hparams(folder: str, params: Mapping[str, Any]) -> str:
    """Write ``params`` to ``<folder>/hparams.yaml`` (creating the folder), replacing the
    file whole; return its path."""
    path = os.path.join(folder, HPARAMS_FILE)
    text = to_yaml(params)  # refused before anything is written
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        raise write_error(path, error) from error
    write_atomically(path, text.encode("utf-8"))
    return path
