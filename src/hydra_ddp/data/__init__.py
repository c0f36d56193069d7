"""Data sources, and the per-rank view of them that a sampling policy asks for.

The contract a data set meets (`DataSource`) is small, so that `sampler=sharded` can make each
rank read only its own rows:

* `num_rows(split)`: rows in "train", "val" or "test";
* `load(split, ranges)`: a dataset holding only the rows in `ranges` (half-open row ranges in
  order; None: the whole split), indexed by whole index arrays: `ds[idx]` with `idx` an int64
  array returns one batch `(x, y)`, so a batch is one vectorised gather, not batch_size calls;
* `spec`: what a model must know about the data, passed to the model's constructor by name
  (e.g. `in_features`, `out_features`, `vocab_size`; see components.py);
* optional `file_rows(split)`, for `sampler.shard_by=files`; optional `unit` / `items_per_row`
  to count throughput in e.g. tokens instead of samples.

What is loaded is checked before training starts (`check_loaded`, run on every `load` result
by `TrainData` and `EvalData`, so a source of yours gets it too): float features and targets
must be finite, integer labels in [0, spec["out_features"]) and tokens in
[0, spec["vocab_size"]). A `Rows` told where its segments came from (`origins`) names the file
and row at fault. Checks that need no rows (shapes, dtypes) belong in the source's
constructor, which runs in the launching process before any worker or process group starts.

A source is a component: `data._target_` names its class and the rest of `data.*` are its
constructor's arguments. `Rows` and `TokenWindows` are ready-made datasets for arrays (the fast
path: one vectorised gather per batch). `TorchDatasets` takes any map-style
`torch.utils.data.Dataset` per split instead (per-item `__getitem__`, transforms, a Hugging Face
`datasets.Dataset`), batched by a `collate_fn` in DataLoader workers.
`TrainData` and `EvalData` tie a source to a sampling policy.

Every source here is real and needs no download: scikit-learn's digits and diabetes ship inside
its package, the text corpus is CPython's own pydoc_data.topics, and synthetic data is written
to disk by scripts/make_synthetic.py.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset, default_collate

from hydra_ddp.components import check
from hydra_ddp.config import SamplerConfig, SamplerPolicy, ShardBy
from hydra_ddp.data.sampling import (
    ShardedSampler,
    StridedSampler,
    partition_files,
    partition_rows,
    samples_per_epoch,
)
from hydra_ddp.dist import DistEnv
from hydra_ddp.errors import UserError, check_regular

log = logging.getLogger(__name__)

Ranges = list[tuple[int, int]]
SPLITS = ("train", "val", "test")


# --------------------------------------------------------------------------------------------
# What a rank holds
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Origin:
    """Where one segment of a `Rows` came from, for error messages: the file (or a name) of
    its x and its y, and the row of that file its first row is."""

    x: str
    y: str
    first_row: int = 0


def _describe(arr: np.ndarray) -> str:
    return f"{arr.dtype} rows of shape {tuple(arr.shape)}"


class Rows(Dataset):
    """Rows of (x, y) arrays, possibly several memory-mapped segments, indexed by index arrays.

    `rows[idx]` with idx an int64 array returns a batch (x, y) of tensors. `origins` (one per
    segment, optional) lets `check_loaded` name the file and row of a bad value.
    """

    def __init__(
        self,
        xs: Sequence[np.ndarray],
        ys: Sequence[np.ndarray],
        origins: Sequence[Origin] | None = None,
    ):
        self.xs, self.ys = list(xs), list(ys)
        self.origins = (
            list(origins)
            if origins is not None
            else [Origin(f"x segment {i}", f"y segment {i}") for i in range(len(self.xs))]
        )
        if not len(self.xs) == len(self.ys) == len(self.origins):
            raise ValueError(
                f"Rows: {len(self.xs)} x segments, {len(self.ys)} y segments and "
                f"{len(self.origins)} origins; pass one of each per segment"
            )
        for x, y, o in zip(self.xs, self.ys, self.origins):
            if len(x) != len(y):
                raise UserError(
                    f"{o.x} has {len(x)} rows but {o.y} has {len(y)}: every row needs "
                    "exactly one label; rewrite the pair"
                )
        # A batch spanning segments is gathered into one array of the first segment's
        # dtype and shape: a segment that differs would be cast or fail mid-training.
        for x, y, o in zip(self.xs[1:], self.ys[1:], self.origins[1:]):
            first = self.origins[0]
            for arr, ref, name, ref_name in (
                (x, self.xs[0], o.x, first.x),
                (y, self.ys[0], o.y, first.y),
            ):
                if arr.dtype != ref.dtype or arr.shape[1:] != ref.shape[1:]:
                    raise UserError(
                        f"{name} holds {_describe(arr)} but {ref_name} holds "
                        f"{_describe(ref)}: every part of a split needs the same row shape "
                        "and dtype; rewrite the odd one"
                    )
        self.starts = np.cumsum([0] + [len(x) for x in xs])

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def nbytes(self) -> int:
        return int(sum(x.nbytes + y.nbytes for x, y in zip(self.xs, self.ys)))

    def __getitem__(self, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = np.asarray(idx, dtype=np.int64)
        if len(self.xs) == 1:
            x, y = self.xs[0][idx], self.ys[0][idx]
        else:
            seg = np.searchsorted(self.starts, idx, side="right") - 1
            local = idx - self.starts[seg]
            x = np.empty((len(idx),) + self.xs[0].shape[1:], dtype=self.xs[0].dtype)
            y = np.empty((len(idx),) + self.ys[0].shape[1:], dtype=self.ys[0].dtype)
            for s in np.unique(seg):
                m = seg == s
                x[m], y[m] = self.xs[s][local[m]], self.ys[s][local[m]]
        y = np.ascontiguousarray(y)
        if np.issubdtype(y.dtype, np.integer):  # class ids: what cross_entropy wants
            y = y.astype(np.int64, copy=False)
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y)


class TokenWindows(Dataset):
    """Row i of a token stream is the window tokens[i*block : i*block + block + 1]; x is its
    first block tokens and y the same shifted by one. Several segments when sharded by ranges."""

    def __init__(self, segments: Sequence[np.ndarray], block_size: int):
        self.segments, self.block = list(segments), block_size
        self.starts = np.cumsum([0] + [(len(s) - 1) // block_size for s in segments])

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def nbytes(self) -> int:
        return int(sum(s.nbytes for s in self.segments))

    def __getitem__(self, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = np.asarray(idx, dtype=np.int64)
        seg = np.searchsorted(self.starts, idx, side="right") - 1
        offsets = (idx - self.starts[seg])[:, None] * self.block + np.arange(self.block + 1)
        out = np.empty((len(idx), self.block + 1), dtype=np.int64)
        for s in np.unique(seg):
            m = seg == s
            out[m] = self.segments[s][offsets[m]]
        t = torch.from_numpy(out)
        # Two contiguous tensors, not views of one: each is pinned and copied to the GPU whole.
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


# --------------------------------------------------------------------------------------------
# Checking what was loaded
# --------------------------------------------------------------------------------------------

# Bytes of rows checked at a time: bounds the temporary mask, and a memory-mapped segment is
# read once, front to back.
_CHECK_CHUNK_BYTES = 1 << 24


def check_loaded(dataset: Dataset, spec: dict[str, Any], split: str) -> None:
    """Refuse loaded rows that would make the loss NaN or the loss function fail, with one
    line naming the file and row (from `Rows.origins`) and what to do.

    `Rows`: floating features and floating targets must be finite; integer labels are class
    ids, so 0 <= y < spec["out_features"]. `TokenWindows`: 0 <= token < spec["vocab_size"].
    Other datasets are left to their source. Vectorised over the rows loaded, chunk by chunk:
    about 2 ms per 100k rows of 64 float32 features on one core.
    """
    where = f"data ({split} split)"
    if isinstance(dataset, Rows):
        classes = spec.get("out_features")
        for x, y, origin in zip(dataset.xs, dataset.ys, dataset.origins):
            _check_finite(x, f"{where}: {origin.x}", origin.first_row, "features")
            if np.issubdtype(y.dtype, np.integer):
                if classes is not None:
                    _check_range(
                        y, f"{where}: {origin.y}", origin.first_row, int(classes), "class id"
                    )
            else:
                _check_finite(y, f"{where}: {origin.y}", origin.first_row, "targets")
    elif isinstance(dataset, TokenWindows) and spec.get("vocab_size"):
        for i, segment in enumerate(dataset.segments):
            name = f"{where}: token segment {i}"
            vocab = int(spec["vocab_size"])
            _check_range(segment, name, 0, vocab, "token id", row_word="position")


def _chunks(arr: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    step = max(1, _CHECK_CHUNK_BYTES // max(arr[:1].nbytes, 1))
    for lo in range(0, len(arr), step):
        yield lo, arr[lo : lo + step]


def _check_finite(arr: np.ndarray, name: str, first_row: int, what: str) -> None:
    if not np.issubdtype(arr.dtype, np.inexact):
        return  # integers and booleans are always finite
    for lo, chunk in _chunks(arr):
        if np.isfinite(chunk).all():
            continue
        # Only on failure: which rows, and how many in the whole segment.
        bad = np.flatnonzero(~np.isfinite(chunk.reshape(len(chunk), -1)).all(axis=1))
        row = lo + int(bad[0])
        value = next(v for v in np.ravel(arr[row]) if not np.isfinite(v))
        value = "NaN" if np.isnan(value) else ("-inf" if value < 0 else "inf")
        count = sum(
            int((~np.isfinite(c.reshape(len(c), -1)).all(axis=1)).sum()) for _, c in _chunks(arr)
        )
        more = f" (and {count - 1} more row(s))" if count > 1 else ""
        raise UserError(
            f"{name} row {first_row + row} has {value} in its {what}{more}: a model "
            "cannot learn from non-finite values; drop or fill those rows and rewrite it"
        )


def _check_range(
    arr: np.ndarray, name: str, first_row: int, limit: int, what: str, row_word: str = "row"
) -> None:
    key = "vocab_size" if what == "token id" else "out_features"
    for lo, chunk in _chunks(arr):
        if not len(chunk) or (chunk.min() >= 0 and chunk.max() < limit):
            continue
        flat = chunk.reshape(len(chunk), -1)
        row = int(np.flatnonzero(((flat < 0) | (flat >= limit)).any(axis=1))[0])
        value = next(int(v) for v in flat[row] if v < 0 or v >= limit)
        raise UserError(
            f"{name} {row_word} {first_row + lo + row} has {what} {value}, outside "
            f"0..{limit - 1} "
            f"({key}={limit}): fix those rows, or the {key} the data source declares"
        )


# --------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------


class DataSource:
    """One data set (see the module docstring for the contract). Subclass it, or write any
    class with the same methods, and point `data._target_` at it."""

    # What the model's constructor receives by name, e.g. {"in_features": 64, "out_features": 10}.
    spec: dict[str, Any] = {}
    # Throughput is reported as <unit>_per_s, counting items_per_row items per row.
    unit: str = "samples"
    items_per_row: int = 1

    def num_rows(self, split: str) -> int:
        raise NotImplementedError

    def file_rows(self, split: str) -> list[int]:
        """Rows per file of a split, in order; one 'file' for sources held in one piece."""
        return [self.num_rows(split)]

    def load(self, split: str, ranges: Ranges | None) -> Dataset:
        """Read only the rows in `ranges` (half-open, in order); None: the whole split."""
        raise NotImplementedError


class TorchDatasets(DataSource):
    """One map-style `torch.utils.data.Dataset` per split, each a component of its own:

        data:
          _target_: hydra_ddp.data.TorchDatasets
          train: {_target_: my_data.Images, root: /data, split: train, augment: true}
          val: {_target_: my_data.Images, root: /data, split: val}
          test: {_target_: my_data.Images, root: /data, split: test}
          spec: {out_features: 10}       # what the model is told (optional)
          collate_fn: null               # default: torch's default_collate

    Items are read one `dataset[i]` at a time, in DataLoader workers (`trainer.num_workers`),
    and batched by `collate_fn`. `sampler=strided` partitions the shared per-epoch permutation
    as for arrays; `sampler=sharded` gives each rank contiguous rows (a `Subset`) and touches no
    other row."""

    per_item = True  # TrainData/EvalData batch it with a DataLoader batch sampler

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
        "see hydra_ddp/data.py) nor a map-style dataset for hydra_ddp.data.TorchDatasets"
    )


def loader(
    source: DataSource, dataset: Dataset, sampler: Any, env: DistEnv, num_workers: int
) -> DataLoader:
    """A DataLoader over `sampler`'s index batches: a whole batch per `dataset[idx]` for array
    sources, `dataset[i]` per item and `collate_fn` for TorchDatasets. Its own generator:
    without one, every iter() draws a seed from the global RNG, so a run resumed mid-epoch (one
    extra iter() after the RNG state is restored) would get other dropout masks than the
    uninterrupted run."""
    common = dict(
        num_workers=num_workers,
        pin_memory=env.device.type == "cuda",
        persistent_workers=num_workers > 0,
        generator=torch.Generator(),
    )
    if getattr(source, "per_item", False):
        return DataLoader(
            dataset,
            batch_sampler=_IndexLists(sampler),
            collate_fn=getattr(source, "collate_fn", None) or default_collate,
            **common,
        )
    # batch_size=None: the sampler yields whole index arrays and the dataset gathers a batch in
    # one call, so the DataLoader only adds workers and pinning when asked for.
    return DataLoader(dataset, sampler=sampler, batch_size=None, **common)


class _IndexLists:
    """A sampler of index arrays as a DataLoader batch sampler (lists of Python ints)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[int]]:
        return (np.asarray(idx).tolist() for idx in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


def check_fractions(val_fraction: float, test_fraction: float) -> None:
    check(0 < val_fraction < 1, "val_fraction", "in (0, 1)", val_fraction)
    check(0 < test_fraction < 1, "test_fraction", "in (0, 1)", test_fraction)
    check(
        val_fraction + test_fraction < 1,
        "val_fraction + test_fraction",
        "< 1",
        val_fraction + test_fraction,
    )


def _split_rows(
    n: int, val_fraction: float, test_fraction: float, seed: int
) -> dict[str, np.ndarray]:
    """A seeded shuffle of range(n) cut into val, test and train row indices."""
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


class Digits(InMemoryArrays):
    """scikit-learn's 8x8 digits, scaled to [0, 1], split train/val/test by a seeded shuffle."""

    def __init__(self, val_fraction: float, test_fraction: float, split_seed: int):
        from sklearn.datasets import load_digits

        check_fractions(val_fraction, test_fraction)
        bunch = load_digits()
        x = (bunch.data / 16.0).astype(np.float32)
        y = bunch.target.astype(np.int64)
        cut = _split_rows(len(x), val_fraction, test_fraction, split_seed)
        self.arrays = {s: (x[i], y[i]) for s, i in cut.items()}
        self.spec = {"in_features": 64, "out_features": 10, "image_shape": (1, 8, 8)}


class Diabetes(InMemoryArrays):
    """scikit-learn's diabetes regression set (442 rows, 10 features). The target is
    standardised with the training split's mean and std, so the MSE reads on a unit scale
    (and 1 - MSE is close to R^2)."""

    def __init__(self, val_fraction: float, test_fraction: float, split_seed: int):
        from sklearn.datasets import load_diabetes

        check_fractions(val_fraction, test_fraction)
        bunch = load_diabetes()
        x = bunch.data.astype(np.float32)
        y = bunch.target.astype(np.float32)[:, None]
        cut = _split_rows(len(x), val_fraction, test_fraction, split_seed)
        mean, std = y[cut["train"]].mean(), y[cut["train"]].std()
        x = (x - x[cut["train"]].mean(0)) / x[cut["train"]].std(0)
        self.arrays = {s: (x[i], (y[i] - mean) / std) for s, i in cut.items()}
        self.spec = {"in_features": x.shape[1], "out_features": 1}


class CharText(DataSource):
    """CPython's pydoc_data.topics, every topic's text joined, as one character stream.

    The tail of the stream is held out (val, then test) so no window straddles two splits.
    """

    unit = "tokens"

    def __init__(self, block_size: int, val_fraction: float, test_fraction: float):
        from pydoc_data.topics import topics

        check(block_size > 0, "block_size", "> 0", block_size)
        check_fractions(val_fraction, test_fraction)
        text = "\n\n".join(topics[k] for k in sorted(topics))
        chars = sorted(set(text))
        lookup = np.zeros(max(map(ord, chars)) + 1, dtype=np.int64)
        lookup[[ord(c) for c in chars]] = np.arange(len(chars))
        tokens = lookup[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)]
        tokens = tokens.astype(np.uint8 if len(chars) <= 256 else np.int32)
        n = len(tokens)
        n_test, n_val = int(n * test_fraction), int(n * val_fraction)
        bounds = {
            "train": (0, n - n_val - n_test),
            "val": (n - n_val - n_test, n - n_test),
            "test": (n - n_test, n),
        }
        self.streams = {s: tokens[a:b] for s, (a, b) in bounds.items()}
        self.block = self.items_per_row = block_size
        for s, stream in self.streams.items():
            if (len(stream) - 1) // block_size < 1:
                raise UserError(
                    f"data.block_size={block_size} is longer than the {s} split "
                    f"({len(stream)} characters): lower data.block_size"
                )
        self.spec = {"vocab_size": len(chars), "block_size": block_size}
        self.chars = "".join(chars)

    def decode(self, tokens: Sequence[int]) -> str:
        """Token ids back to text."""
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
        self.features, self.classes = features, classes
        self.spec = {"in_features": features, "out_features": classes}
        # Every shard's header (np.load with mmap_mode reads only that), so a wrong shape or
        # dtype fails here, in the launching process, naming the file.
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
                f"{path} is missing (listed in {self.root / 'manifest.json'}): "
                "recreate the data set with scripts/make_synthetic.py"
            ) from e
        except (ValueError, OSError) as e:
            raise UserError(
                f"{path} is not a readable .npy file ({e}): recreate the data set "
                "with scripts/make_synthetic.py"
            ) from e
        if len(arr) != rows:
            raise UserError(
                f"{path} holds {len(arr)} rows but the manifest says {rows}: "
                "recreate the data set with scripts/make_synthetic.py"
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
                f"{manifest}: shard entry {entry!r} needs x, y and rows ({e!r}): recreate it "
                "with scripts/make_synthetic.py"
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


# --------------------------------------------------------------------------------------------
# Tying a source to a sampling policy
# --------------------------------------------------------------------------------------------


class TrainData:
    """The training split as this rank sees it under sampler=strided or sampler=sharded.

    Iterate `epoch(e, start_batch)` for the batches of epoch e from a given batch on; every
    rank gets the same number of batches per epoch (`steps_per_epoch`), which DDP needs.
    """

    def __init__(
        self,
        source: DataSource,
        cfg: SamplerConfig,
        env: DistEnv,
        batch_size: int,
        seed: int,
        num_workers: int = 0,
    ):
        self.source, self.cfg, self.env = source, cfg, env
        self.num_workers, self.batch_size = num_workers, batch_size
        n, world = source.num_rows("train"), env.world_size
        check_sampling(source, cfg, world, batch_size)
        if cfg.policy == SamplerPolicy.strided:
            self.dataset = source.load("train", None)
            check_loaded(self.dataset, source.spec, "train")
            self.sampler = StridedSampler(
                n,
                env.rank,
                world,
                batch_size,
                shuffle=cfg.shuffle,
                seed=seed,
                drop_last=cfg.drop_last,
            )
            self._part_epoch: int | None = None
        else:
            parts = self._parts(0)
            self.sampler = ShardedSampler(
                _rows_in(parts[env.rank]),
                samples_per_epoch(parts),
                env.rank,
                batch_size,
                shuffle=cfg.shuffle,
                seed=seed,
                drop_last=cfg.drop_last,
            )
            self._load_part(0)
        if len(self.sampler) == 0:
            raise UserError(
                f"trainer.batch_size={batch_size} with sampler.drop_last=true leaves "
                "no full batch per rank: lower trainer.batch_size"
            )
        self.loader = self._make_loader()

    def _parts(self, epoch: int) -> list[Ranges]:
        world, rotate = self.env.world_size, self.cfg.rotate
        if self.cfg.shard_by == ShardBy.files:
            return partition_files(self.source.file_rows("train"), world, epoch, rotate)
        return partition_rows(self.source.num_rows("train"), world, epoch, rotate)

    def _load_part(self, epoch: int) -> None:
        parts = self._parts(epoch)
        self.dataset = self.source.load("train", parts[self.env.rank])
        check_loaded(self.dataset, self.source.spec, "train")
        self.sampler.resize(len(self.dataset), samples_per_epoch(parts))
        self._part_epoch = epoch

    def _make_loader(self) -> DataLoader:
        return loader(self.source, self.dataset, self.sampler, self.env, self.num_workers)

    @property
    def steps_per_epoch(self) -> int:
        return len(self.sampler)

    @property
    def rows_held(self) -> int:
        return len(self.dataset)

    @property
    def bytes_held(self) -> int:
        return int(getattr(self.dataset, "nbytes", 0))

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator:
        """Batches of `epoch`, skipping the first `start_batch` (resuming mid-epoch)."""
        if (
            self.cfg.policy == SamplerPolicy.sharded
            and self.cfg.rotate
            and self._part_epoch != epoch
        ):
            self._load_part(epoch)
            self.loader = self._make_loader()
        self.sampler.load_state_dict({"epoch": epoch, "start_batch": start_batch})
        return iter(self.loader)


def check_sampling(source: DataSource, cfg: SamplerConfig, world: int, batch_size: int) -> None:
    """Refuse a policy the training split cannot support, before any data is loaded."""
    n = source.num_rows("train")
    if cfg.policy == SamplerPolicy.strided:
        if cfg.drop_last and n < world:
            raise UserError(
                f"sampler.drop_last=true needs at least one training row per rank: "
                f"{n} rows for {world} ranks; use fewer processes"
            )
        return
    if n < world:
        raise UserError(
            f"sampler=sharded needs at least one training row per rank: the training "
            f"split has {n} rows for {world} ranks; use fewer processes or "
            "sampler=strided"
        )
    files = source.file_rows("train")
    if cfg.shard_by == ShardBy.files and len(files) < world:
        raise UserError(
            f"sampler.shard_by=files needs at least one file per rank: {len(files)} "
            f"file(s) for {world} ranks; use sampler.shard_by=rows or write more "
            "shards (scripts/make_synthetic.py --shards)"
        )
    if cfg.drop_last and n // world < batch_size:
        raise UserError(
            f"sampler=sharded with drop_last=true: each rank holds about {n // world} "
            f"rows, fewer than trainer.batch_size={batch_size}; lower "
            "trainer.batch_size"
        )


def _rows_in(ranges: Ranges) -> int:
    return sum(b - a for a, b in ranges)


class EvalData:
    """A held-out split, partitioned so each row is evaluated exactly once across ranks
    (no DistributedSampler padding: ranks may hold one row more or less)."""

    def __init__(
        self,
        source: DataSource,
        split: str,
        policy: SamplerPolicy,
        env: DistEnv,
        batch_size: int,
        num_workers: int = 0,
    ):
        self.source, self.env, self.num_workers = source, env, num_workers
        n = source.num_rows(split)
        self.first_row = 0  # the split's row number of this rank's first loaded row
        if policy == SamplerPolicy.strided:
            self.dataset = source.load(split, None)
            check_loaded(self.dataset, source.spec, split)
            self.sampler = StridedSampler(
                n, env.rank, env.world_size, batch_size, shuffle=False, pad=False
            )
        else:
            # Each rank reads only its own contiguous part of the split.
            part = partition_rows(n, env.world_size)[env.rank]
            self.first_row = part[0][0] if part else 0
            self.dataset = source.load(split, part)
            check_loaded(self.dataset, source.spec, split)
            self.sampler = (
                StridedSampler(
                    max(len(self.dataset), 1), 0, 1, batch_size, shuffle=False, pad=False
                )
                if len(self.dataset)
                else None
            )

        self._loader: DataLoader | None = None

    def rows(self) -> Iterator[np.ndarray]:
        """The split's row numbers of each batch `__iter__` yields, in the same order (one pass
        of the sampler: finish it before iterating the batches)."""
        if self.sampler is None:
            return iter(())
        return (np.asarray(idx) + self.first_row for idx in self.sampler)

    def __iter__(self) -> Iterator:
        if self.sampler is None:
            return iter(())
        if self._loader is None:  # made once: its workers persist between evaluations
            self._loader = loader(
                self.source, self.dataset, self.sampler, self.env, self.num_workers
            )
        return iter(self._loader)
