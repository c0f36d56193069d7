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

A source is a component: `data._target_` names its class and the rest of `data.*` are its
constructor's arguments. `Rows` and `TokenWindows` are ready-made datasets for arrays.
`TrainData` and `EvalData` tie a source to a sampling policy.

Every source here is real and needs no download: scikit-learn's digits and diabetes ship inside
its package, the text corpus is CPython's own pydoc_data.topics, and synthetic data is written
to disk by scripts/make_synthetic.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from hydra_ddp.components import check
from hydra_ddp.config import SamplerConfig, SamplerPolicy, ShardBy
from hydra_ddp.dist import DistEnv
from hydra_ddp.errors import UserError
from hydra_ddp.sampling import (
    ShardedSampler,
    StridedSampler,
    partition_files,
    partition_rows,
    samples_per_epoch,
)

log = logging.getLogger(__name__)

Ranges = list[tuple[int, int]]
SPLITS = ("train", "val", "test")


# --------------------------------------------------------------------------------------------
# What a rank holds
# --------------------------------------------------------------------------------------------


class Rows(Dataset):
    """Rows of (x, y) arrays, possibly several memory-mapped segments, indexed by index arrays.

    `rows[idx]` with idx an int64 array returns a batch (x, y) of tensors.
    """

    def __init__(self, xs: Sequence[np.ndarray], ys: Sequence[np.ndarray]):
        self.xs, self.ys = list(xs), list(ys)
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
        return t[:, :-1], t[:, 1:]


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
        return Rows([x[a:b] for a, b in ranges], [y[a:b] for a, b in ranges])


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

    def num_rows(self, split: str) -> int:
        return (len(self.streams[split]) - 1) // self.block

    def load(self, split: str, ranges: Ranges | None) -> TokenWindows:
        stream = self.streams[split]
        ranges = ranges if ranges is not None else [(0, self.num_rows(split))]
        # +1: a window needs the character after its last one as a target.
        return TokenWindows(
            [stream[a * self.block : b * self.block + 1] for a, b in ranges], self.block
        )


class SyntheticArrays(DataSource):
    """A classification set stored as .npy shards plus manifest.json (see
    scripts/make_synthetic.py). Reads are memory-mapped, so only the rows asked for are ever
    read from disk; with in_memory they are then copied into RAM."""

    def __init__(self, path: str, in_memory: bool):
        self.root, self.in_memory = Path(path), in_memory
        manifest = self.root / "manifest.json"
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
        self.spec = {"in_features": features, "out_features": classes}

    def num_rows(self, split: str) -> int:
        return sum(self.file_rows(split))

    def file_rows(self, split: str) -> list[int]:
        return [int(f["rows"]) for f in self.files[split]]

    def _open(self, name: str, rows: int) -> np.ndarray:
        path = self.root / name
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

    def load(self, split: str, ranges: Ranges | None) -> Rows:
        files = self.files[split]
        ranges = ranges if ranges is not None else [(0, self.num_rows(split))]
        starts = np.cumsum([0] + [int(f["rows"]) for f in files])
        xs, ys = [], []
        # A global range may cross file boundaries: cut it into one piece per file.
        for a, b in ranges:
            for i, f in enumerate(files):
                lo, hi = max(a, starts[i]), min(b, starts[i + 1])
                if lo >= hi:
                    continue
                x = self._open(f["x"], int(f["rows"]))[lo - starts[i] : hi - starts[i]]
                y = self._open(f["y"], int(f["rows"]))[lo - starts[i] : hi - starts[i]]
                xs.append(np.array(x) if self.in_memory else x)
                ys.append(np.array(y) if self.in_memory else y)
        return Rows(xs, ys)


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
        self.sampler.resize(len(self.dataset), samples_per_epoch(parts))
        self._part_epoch = epoch

    def _make_loader(self) -> DataLoader:
        # batch_size=None: the sampler yields whole index arrays and the dataset gathers a
        # batch in one call, so the DataLoader only adds workers and pinning when asked for.
        # Its own generator: without one, every iter() draws a seed from the global RNG, so a
        # run resumed mid-epoch (one extra iter() after the RNG state is restored) would get
        # other dropout masks than the uninterrupted run.
        return DataLoader(
            self.dataset,
            sampler=self.sampler,
            batch_size=None,
            num_workers=self.num_workers,
            pin_memory=self.env.device.type == "cuda",
            persistent_workers=self.num_workers > 0,
            generator=torch.Generator(),
        )

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
        self, source: DataSource, split: str, policy: SamplerPolicy, env: DistEnv, batch_size: int
    ):
        n = source.num_rows(split)
        if policy == SamplerPolicy.strided:
            self.dataset = source.load(split, None)
            self.sampler = StridedSampler(
                n, env.rank, env.world_size, batch_size, shuffle=False, pad=False
            )
        else:
            # Each rank reads only its own contiguous part of the split.
            part = partition_rows(n, env.world_size)[env.rank]
            self.dataset = source.load(split, part)
            self.sampler = (
                StridedSampler(
                    max(len(self.dataset), 1), 0, 1, batch_size, shuffle=False, pad=False
                )
                if len(self.dataset)
                else None
            )

    def __iter__(self) -> Iterator:
        if self.sampler is None:
            return iter(())
        return (self.dataset[idx] for idx in self.sampler)
