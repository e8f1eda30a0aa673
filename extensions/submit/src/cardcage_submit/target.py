"""What each job runs: the target (a callable, ``module:function``, ``file.py:function`` or a
script) and the grid point that submitit pickles into the job with it."""

from __future__ import annotations

import importlib
import os
import runpy
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cardcage.sdk import MisconfigurationError
from cardcage_submit.files import _json_safe
from cardcage_submit.grid import Value

if TYPE_CHECKING:
    from cardcage_submit.plan import Plan


@dataclass(frozen=True)
class Target:
    """What each job runs: a callable, ``module:function``, ``file.py:function`` or a script."""

    kind: str  # callable | import | file | script
    spec: str
    function: Callable[..., Any] | None = None
    path_entry: str | None = None  # sys.path entry for an import target (the submit folder)

    @classmethod
    def of(cls, target: str | os.PathLike[str] | Callable[..., Any]) -> Target:
        if callable(target):
            name = getattr(target, "__qualname__", None) or repr(target)
            module = getattr(target, "__module__", None)
            return cls("callable", f"{module}:{name}" if module else name, target)
        if not isinstance(target, (str, os.PathLike)):
            raise MisconfigurationError(
                f"target={target!r} is not valid: give a function, 'module:function', "
                "'path/to/file.py:function' or 'path/to/script.py'."
            )
        text = os.fspath(target)
        location, colon, attribute = text.rpartition(":")
        if colon and location and attribute.isidentifier():
            if location.endswith(".py"):
                path = Path(location).expanduser().resolve()
                if not path.is_file():
                    raise MisconfigurationError(
                        f"target={text!r}: {location} is not a file. Give the path of the "
                        "Python file that defines the function."
                    )
                return cls("file", f"{path}:{attribute}")
            cwd = os.getcwd()
            added = cwd not in sys.path
            if added:
                sys.path.insert(0, cwd)
            try:
                module = importlib.import_module(location)
            except ImportError as error:
                raise MisconfigurationError(
                    f"target={text!r}: module {location!r} cannot be imported here ({error}). "
                    "Run from the folder that holds it, or give 'path/to/file.py:function'."
                ) from None
            finally:
                if added:
                    sys.path.remove(cwd)
            if not callable(getattr(module, attribute, None)):
                raise MisconfigurationError(
                    f"target={text!r}: module {location!r} has no function {attribute!r}."
                )
            return cls("import", text, path_entry=cwd)
        path = Path(text).expanduser().resolve()
        if text.endswith(".py") and path.is_file():
            return cls("script", str(path))
        raise MisconfigurationError(
            f"target={text!r} is neither a Python script (an existing .py file) nor "
            "'module:function' / 'path/to/file.py:function'."
        )

    def load(self) -> Callable[..., Any]:
        """The function (inside the job)."""
        if self.function is not None:
            return self.function
        location, _, attribute = self.spec.rpartition(":")
        if self.kind == "file":
            namespace = runpy.run_path(location, run_name="cardcage_submitted")
            function = namespace[attribute]
        else:
            if self.path_entry and self.path_entry not in sys.path:
                sys.path.insert(0, self.path_entry)
            function = getattr(importlib.import_module(location), attribute)
        if not callable(function):
            raise TypeError(f"{self.spec} is not callable")
        return function  # type: ignore[no-any-return]


@dataclass(frozen=True)
class GridPoint:
    """One job of a grid, as pickled into the job (everything it needs to run)."""

    index: int
    count: int
    hparams: dict[str, Value]
    folder: str
    target: Target
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    requeue_signal: str | None = None

    def record(self, plan: Plan, job_id: str | None = None) -> dict[str, Any]:
        return {
            "index": self.index,
            "count": self.count,
            "hparams": self.hparams,
            "folder": self.folder,
            "target": self.target.spec,
            "job_id": job_id,
            "trainer_flags": _json_safe(plan.trainer_flags),
            "accelerator": plan.accelerator,
            "nodes": plan.job.nodes,
            "processes_per_node": plan.processes_per_node,
        }
