"""The data sources that ship with the template, and `DataSource`, a base for yours (the
contract: `hydra_ddp.protocols.DataSource`): arrays in RAM (`InMemoryArrays`: digits, diabetes),
a character stream (`CharText`), .npy shards on disk (`SyntheticArrays`) and map-style torch
datasets (`TorchDatasets`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from torch.utils.data import Dataset, Subset

from hydra_ddp.data.datasets import SPLITS, Origin, Rows, TokenWindows, _describe
from hydra_ddp.data.split_record import ranges_of
from hydra_ddp.disk import check_regular
from hydra_ddp.errors import UserError, check
from hydra_ddp.protocols import Ranges


class DataSource:
    """One data set, with the optional parts' defaults (the contract, method by method:
    `hydra_ddp.protocols.DataSource`). Subclass it, or write any class with the same methods,
    and point `data._target_` at it."""

    spec: dict[str, Any] = {}
    unit: str = "samples"
    items_per_row: int = 1

    def num_rows(self, split: str) -> int:
        raise NotImplementedError

    def file_rows(self, split: str) -> list[int]:
        return [self.num_rows(split)]  # one 'file' for sources held in one piece

    def load(self, split: str, ranges: Ranges | None) -> Dataset:
        raise NotImplementedError

    def origin(self, split: str) -> Ranges | None:
        return None  # not known: a resume that changes the split cannot say so


class TorchDatasets(DataSource):
    """One map-style `torch.utils.data.Dataset` per split, each a component of its own (the
    YAML: docs/make_it_yours.md), read one `dataset[i]` at a time and batched by `collate_fn`
    (default: torch's `default_collate`); `sampler=sharded` gives each rank a `Subset`."""

    per_item = True  # batched by a DataLoader batch sampler (view.loader)

    def __init__(
        self,
        train: Any,
        val: Any,
        test: Any,
        collate_fn: Any = None,
        spec: dict[str, Any] | None = None,
        unit: str = "samples",
    ) -> None:
        self.splits = {"train": train, "val": val, "test": test}
        for split, dataset in self.splits.items():
            if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
                raise UserError(
                    f"data.{split} is a {type(dataset).__name__}, not a map-style dataset "
                    "(__getitem__ and __len__): give a torch.utils.data.Dataset component"
                )
            if len(dataset) == 0:
                raise UserError(f"data.{split} ({type(dataset).__name__}) holds no rows")
        self.collate_fn, self.spec, self.unit = collate_fn, dict(spec or {}), unit

    def num_rows(self, split: str) -> int:
        return len(self.splits[split])

    def load(self, split: str, ranges: Ranges | None) -> Dataset:
        dataset = self.splits[split]
        if ranges is None:
            return dataset
        return Subset(dataset, [i for a, b in ranges for i in range(a, b)])


def check_source(source: Any) -> None:
    """Refuse a `data` component that meets neither contract, in one line naming both."""
    if callable(getattr(source, "num_rows", None)) and callable(getattr(source, "load", None)):
        return
    what = f"data._target_ built a {type(source).__module__}.{type(source).__qualname__}"
    if hasattr(source, "__getitem__") and hasattr(source, "__len__"):
        raise UserError(
            f"{what}, a per-item dataset: give one per split through data._target_="
            "hydra_ddp.data.TorchDatasets (data.train, data.val, data.test), or write a "
            "DataSource (num_rows(split), load(split, ranges), spec)"
        )
    raise UserError(
        f"{what}, which is neither a DataSource (num_rows(split), load(split, ranges), spec; "
        "see hydra_ddp/data/sources.py) nor a map-style dataset for hydra_ddp.data.TorchDatasets"
    )


def check_fractions(val_fraction: float, test_fraction: float) -> None:
    check(0 < val_fraction < 1, "val_fraction", "in (0, 1)", val_fraction)
    check(0 < test_fraction < 1, "test_fraction", "in (0, 1)", test_fraction)
    check(
        val_fraction + test_fraction < 1,
        "val_fraction + test_fraction",
        "< 1",
        val_fraction + test_fraction,
    )


def _settings(val_fraction: float, test_fraction: float, split_seed: Any = None) -> dict:
    out = {"val_fraction": float(val_fraction), "test_fraction": float(test_fraction)}
    return out if split_seed is None else {**out, "split_seed": int(split_seed)}


def _split_rows(
    n: int, val_fraction: float, test_fraction: float, seed: int
) -> dict[str, np.ndarray]:
    """A seeded shuffle of range(n) cut into val, test and train row indices (also what the
    checkpoint's split record says, see `InMemoryArrays.origin`)."""
    check_fractions(val_fraction, test_fraction)
    order = np.random.default_rng(seed).permutation(n)
    n_val, n_test = round(n * val_fraction), round(n * test_fraction)
    return {
        "val": order[:n_val],
        "test": order[n_val : n_val + n_test],
        "train": order[n_val + n_test :],
    }


class InMemoryArrays(DataSource):
    """A source held in RAM as one (x, y) array pair per split."""

    arrays: dict[str, tuple[np.ndarray, np.ndarray]]
    # Each split's row numbers in the original arrays when cut from one, and what cut them:
    # a checkpoint records them (split_record.py).
    origins: dict[str, np.ndarray] | None = None
    split_settings: dict[str, Any] | None = None

    def origin(self, split: str) -> Ranges | None:
        if self.origins is None:
            return None
        return [(int(a), int(b)) for a, b in ranges_of(self.origins[split])]

    def num_rows(self, split: str) -> int:
        return len(self.arrays[split][1])

    def load(self, split: str, ranges: Ranges | None) -> Rows:
        x, y = self.arrays[split]
        ranges = ranges if ranges is not None else [(0, len(y))]
        name = type(self).__name__
        return Rows(
            [x[a:b] for a, b in ranges],
            [y[a:b] for a, b in ranges],
            [Origin(f"{name} {split} x", f"{name} {split} y", a) for a, _ in ranges],
        )


def split_digits(
    val_fraction: float, test_fraction: float, split_seed: int
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """scikit-learn's 8x8 digits and their split, the one place that cuts them (`Digits` and the
    examples' digit datasets hold the same rows): the images flattened to [1797, 64] float32 in
    [0, 1], the labels (int64), and each split's row indices."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32)
    y = bunch.target.astype(np.int64)
    return x, y, _split_rows(len(x), val_fraction, test_fraction, split_seed)


class Digits(InMemoryArrays):
    """scikit-learn's 8x8 digits, scaled to [0, 1], split train/val/test by a seeded shuffle."""

    def __init__(self, val_fraction: float, test_fraction: float, split_seed: int):
        x, y, cut = split_digits(val_fraction, test_fraction, split_seed)
        self.origins = cut
        self.split_settings = _settings(val_fraction, test_fraction, split_seed)
        self.arrays = {s: (x[i], y[i]) for s, i in cut.items()}
        self.spec = {"in_features": 64, "out_features": 10, "image_shape": (1, 8, 8)}


class Diabetes(InMemoryArrays):
    """scikit-learn's diabetes regression set (442 rows, 10 features). The target is
    standardised with the training split's mean and std, so the MSE reads on a unit scale
    (and 1 - MSE is close to R^2)."""

    def __init__(self, val_fraction: float, test_fraction: float, split_seed: int):
        from sklearn.datasets import load_diabetes

        bunch = load_diabetes()
        x = bunch.data.astype(np.float32)
        y = bunch.target.astype(np.float32)[:, None]
        cut = self.origins = _split_rows(len(x), val_fraction, test_fraction, split_seed)
        self.split_settings = _settings(val_fraction, test_fraction, split_seed)
        mean, std = y[cut["train"]].mean(), y[cut["train"]].std()
        x = (x - x[cut["train"]].mean(0)) / x[cut["train"]].std(0)
        self.arrays = {s: (x[i], (y[i] - mean) / std) for s, i in cut.items()}
        self.spec = {"in_features": x.shape[1], "out_features": 1}


class CharText(DataSource):
    """CPython's pydoc_data.topics, every topic's text joined, as one character stream; its
    tail is held out (val, then test) so no window straddles two splits."""

    unit = "tokens"

    def __init__(self, block_size: int, val_fraction: float, test_fraction: float):
        from pydoc_data.topics import topics

        check(block_size > 0, "block_size", "> 0", block_size)
        check_fractions(val_fraction, test_fraction)
        text = "\n\n".join(topics[k] for k in sorted(topics))
        # Token ids: each character's rank among the text's distinct characters.
        codes, tokens = np.unique(
            np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32), return_inverse=True
        )
        tokens = tokens.astype(np.uint8 if len(codes) <= 256 else np.int32)
        n = len(tokens)
        n_test, n_val = int(n * test_fraction), int(n * val_fraction)
        bounds = {
            "train": (0, n - n_val - n_test),
            "val": (n - n_val - n_test, n - n_test),
            "test": (n - n_test, n),
        }
        self.streams = {s: tokens[a:b] for s, (a, b) in bounds.items()}
        self.bounds = bounds
        self.split_settings = _settings(val_fraction, test_fraction)
        self.block = self.items_per_row = block_size
        for s, stream in self.streams.items():
            if (len(stream) - 1) // block_size < 1:
                raise UserError(
                    f"data.block_size={block_size} is longer than the {s} split "
                    f"({len(stream)} characters): lower data.block_size"
                )
        self.spec = {"vocab_size": len(codes), "block_size": block_size}
        self.chars = "".join(map(chr, codes))

    origin_unit = "characters"

    def origin(self, split: str) -> Ranges | None:
        return [self.bounds[split]]

    def decode(self, tokens: Sequence[int]) -> str:
        return "".join(self.chars[t] for t in tokens)

    def num_rows(self, split: str) -> int:
        return (len(self.streams[split]) - 1) // self.block

    def load(self, split: str, ranges: Ranges | None) -> TokenWindows:
        stream = self.streams[split]
        ranges = ranges if ranges is not None else [(0, self.num_rows(split))]
        # +1: a window needs the character after its last one as a target.
        return TokenWindows(
            [stream[a * self.block : b * self.block + 1] for a, b in ranges], self.block
        )


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
        self.features = features
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
        starts = np.cumsum([0] + self.file_rows(split))
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
