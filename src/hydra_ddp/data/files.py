"""A data set stored on disk as .npy shards plus a manifest (scripts/make_synthetic.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from hydra_ddp.data.datasets import SPLITS, Origin, Rows, _describe
from hydra_ddp.data.sources import DataSource
from hydra_ddp.disk import check_regular
from hydra_ddp.errors import UserError
from hydra_ddp.protocols import Ranges

_RECREATE = "recreate the data set with scripts/make_synthetic.py"


class SyntheticArrays(DataSource):
    """A classification set stored as .npy shards plus manifest.json (see
    scripts/make_synthetic.py). Reads are memory-mapped, so only the rows asked for are ever
    read from disk; with in_memory they are then copied into RAM."""

    def __init__(self, path: str, in_memory: bool):
        self.root, self.in_memory = Path(path), in_memory
        manifest = self.root / "manifest.json"
        try:
            self.root.resolve(strict=True)
        except RuntimeError:  # a symlink that points back at itself
            raise UserError(
                f"data.path={path} is a symlink loop: point it at the data set's folder"
            ) from None
        except OSError:
            pass  # missing: said below, with how to create it
        check_regular(manifest, f"data.path={path}:", _RECREATE)
        if not manifest.is_file():
            raise UserError(
                f"data.path={path}: {manifest} not found; create the data set "
                f"with `python scripts/make_synthetic.py --out {path}`"
            )
        try:
            meta = json.loads(manifest.read_text())
            self.files = {s: meta["splits"][s] for s in SPLITS}
            features, classes = int(meta["features"]), int(meta["classes"])
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(
                f"{manifest} is not a valid manifest ({e!r}): recreate it with "
                f"`python scripts/make_synthetic.py --out {path}`"
            ) from e
        self.features, self.classes = features, classes
        self.spec = {"in_features": features, "out_features": classes}
        # Every shard's header (np.load with mmap_mode reads only that): a wrong shape or dtype
        # fails here, in the launching process, naming the file.
        for split in SPLITS:
            for entry in self.files[split]:
                self._open_pair(entry)

    def num_rows(self, split: str) -> int:
        return sum(self.file_rows(split))

    def file_rows(self, split: str) -> list[int]:
        return [int(f["rows"]) for f in self.files[split]]

    def _open(self, name: str, rows: int) -> np.ndarray:
        path = self.root / name
        check_regular(path, "data file", f"put the shard itself there; {_RECREATE}")
        try:
            arr = np.load(path, mmap_mode="r")
        except FileNotFoundError as e:
            raise UserError(
                f"{path} is missing (listed in {self.root / 'manifest.json'}): {_RECREATE}"
            ) from e
        except (ValueError, OSError) as e:
            raise UserError(f"{path} is not a readable .npy file ({e}): {_RECREATE}") from e
        if len(arr) != rows:
            raise UserError(
                f"{path} holds {len(arr)} rows but the manifest says {rows}: {_RECREATE}"
            )
        return arr

    def _open_pair(self, entry: Any) -> tuple[np.ndarray, np.ndarray]:
        """A shard's (x, y), memory-mapped, after checking their headers against the
        manifest: x float32 of shape (rows, features), y integer class ids of shape (rows,)."""
        manifest = self.root / "manifest.json"
        try:
            x_name, y_name, rows = entry["x"], entry["y"], int(entry["rows"])
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(
                f"{manifest}: shard entry {entry!r} needs x, y and rows ({e!r}): {_RECREATE}"
            ) from None
        x, y = self._open(x_name, rows), self._open(y_name, rows)
        if x.ndim != 2 or x.shape[1] != self.features:
            raise UserError(
                f"{self.root / x_name} holds {_describe(x)} but {manifest} says "
                f"{self.features} features per row: rewrite that shard with {self.features} "
                "features (or fix 'features' in the manifest if every shard has "
                f"{x.shape[1] if x.ndim == 2 else 'another count'})"
            )
        if x.dtype != np.float32:
            raise UserError(
                f"{self.root / x_name} holds {_describe(x)}, not float32: models here are "
                "float32; rewrite it with x.astype(np.float32)"
            )
        if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            raise UserError(
                f"{self.root / y_name} holds {_describe(y)}, not one integer class id per "
                "row: rewrite it as a 1-D integer array (e.g. y.astype(np.int16))"
            )
        return x, y

    def load(self, split: str, ranges: Ranges | None) -> Rows:
        files = self.files[split]
        ranges = ranges if ranges is not None else [(0, self.num_rows(split))]
        starts = np.cumsum([0] + [int(f["rows"]) for f in files])
        xs, ys, origins = [], [], []
        # A global range may cross file boundaries: cut it into one piece per file.
        for a, b in ranges:
            for i, f in enumerate(files):
                lo, hi = max(a, starts[i]), min(b, starts[i + 1])
                if lo >= hi:
                    continue
                x, y = self._open_pair(f)
                x, y = x[lo - starts[i] : hi - starts[i]], y[lo - starts[i] : hi - starts[i]]
                xs.append(np.array(x) if self.in_memory else x)
                ys.append(np.array(y) if self.in_memory else y)
                origins.append(
                    Origin(str(self.root / f["x"]), str(self.root / f["y"]), int(lo - starts[i]))
                )
        return Rows(xs, ys, origins)
