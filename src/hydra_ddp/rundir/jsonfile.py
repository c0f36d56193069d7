"""The JSON side files a job writes and reads back (summary.json, failure.json, ...): written
atomically (a temporary file, renamed), non-finite numbers as null, which JSON lacks.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from hydra_ddp.disk import read_regular

_FIX = "remove it, or move it away (the job keeps a regular file there)"


def finite_or_none(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def read(path: Path) -> Any:
    """The file's content; None when missing or not JSON. A FIFO there is refused (UserError)."""
    try:
        return json.loads(read_regular(Path(path), what="file", fix=_FIX))
    except (OSError, ValueError):
        return None


def write(path: Path, obj: Any, indent: int | None = 2) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(_finite(obj), indent=indent, allow_nan=False) + "\n", "utf-8")
    tmp.replace(path)


def _finite(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return finite_or_none(obj)
