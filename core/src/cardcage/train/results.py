"""What ``trainer.validate()`` and ``trainer.test()`` return: Lightning 1.0's list of dicts,
one per loader, that still answers the dict cardcage returned before (the means over every
loader) for one release, with a ``DeprecationWarning``."""

from __future__ import annotations

import warnings
from collections.abc import ItemsView, KeysView, Mapping, ValuesView
from typing import Any, SupportsIndex, overload

_DEPRECATED = (
    "trainer.validate() and trainer.test() return Lightning 1.0's list of dicts, one per "
    "dataloader (results[0]['{key}'] with one loader); reading them as one dict "
    "(results['{key}'], .keys(), ==  a dict) is deprecated and stops working in the next "
    "release."
)


def _warn(key: object = "<name>") -> None:
    warnings.warn(_DEPRECATED.format(key=key), DeprecationWarning, stacklevel=3)


class EvaluationResults(list[dict[str, float]]):
    """One dict of metrics per loader, in order (``results[0]["test_loss"]``).

    Read with a string key, or as a mapping (``keys``, ``items``, ``values``, ``get``,
    ``in``, ``==`` a dict), it is the dict of means over every loader that cardcage
    returned before, with a ``DeprecationWarning``."""

    def __init__(self, per_loader: list[dict[str, float]], combined: Mapping[str, float]):
        super().__init__(per_loader)
        self.combined = dict(combined)

    @overload
    def __getitem__(self, index: SupportsIndex) -> dict[str, float]: ...
    @overload
    def __getitem__(self, index: slice) -> list[dict[str, float]]: ...
    @overload
    def __getitem__(self, index: str) -> float: ...
    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, str):
            _warn(index)
            return self.combined[index]
        return super().__getitem__(index)

    def __contains__(self, item: object) -> bool:
        if isinstance(item, str):
            _warn(item)
            return item in self.combined
        return super().__contains__(item)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            _warn()
            return self.combined == dict(other)
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]

    def keys(self) -> KeysView[str]:
        _warn()
        return self.combined.keys()

    def values(self) -> ValuesView[float]:
        _warn()
        return self.combined.values()

    def items(self) -> ItemsView[str, float]:
        _warn()
        return self.combined.items()

    def get(self, key: str, default: Any = None) -> Any:
        _warn(key)
        return self.combined.get(key, default)
