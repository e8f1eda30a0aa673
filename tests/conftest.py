"""Makes tests/plugin_install.py and tests/processes.py importable (as ``plugin_install`` and
``processes``) by the test files here.

pyproject.toml runs pytest with ``--import-mode=importlib``, which leaves tests/ off
``sys.path``, so a test module cannot import a helper module next to it on its own. This
imports it once (with pytest's assertion rewriting, as in a test module) and leaves
``sys.path`` as it was.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

HERE = str(Path(__file__).resolve().parent)

for _helper in ("plugin_install", "processes"):
    pytest.register_assert_rewrite(_helper)
    if _helper not in sys.modules:
        sys.path.insert(0, HERE)
        try:
            importlib.import_module(_helper)
        finally:
            sys.path.remove(HERE)
