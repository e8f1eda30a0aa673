"""The files of a grid folder: their names, and the JSON cardcage writes to them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

MANIFEST = "grid.json"
POINT_FILE = "hparams.json"
RESULT_FILE = "result.json"


def _json_safe(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return None


def _write_json(path: Path, data: Any) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(temporary, path)
