"""What a data source's `load` returns, and the check of it before training starts.

`Rows` (x, y pairs, possibly several memory-mapped segments) and `TokenWindows` (a token
stream cut into windows) are the fast path: `ds[idx]` with an int64 index array is one
vectorised gather per batch. `Origin` lets an error name the file and row a value came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from hydra_ddp.errors import UserError

SPLITS = ("train", "val", "test")
# Bytes of rows checked at a time: bounds the temporary mask, and a memory-mapped segment is
# read once, front to back.
_CHECK_CHUNK_BYTES = 1 << 24


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
    """Rows of (x, y) arrays, possibly several segments; `rows[idx]` with idx an int64 array
    returns a batch (x, y) of tensors. `origins`: one per segment, optional."""

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
            for arr, ref, name, ref_name in (
                (x, self.xs[0], o.x, self.origins[0].x),
                (y, self.ys[0], o.y, self.origins[0].y),
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


def check_loaded(dataset: Dataset, spec: dict[str, Any], split: str) -> None:
    """Refuse loaded rows that would make the loss NaN or the loss function fail, in one line
    naming the file and row and what to do: in `Rows`, floats must be finite and integer labels
    in [0, spec["out_features"]); in `TokenWindows`, tokens in [0, spec["vocab_size"]). Other
    datasets are left to their source."""
    where = f"data ({split} split)"
    if isinstance(dataset, Rows):
        classes = spec.get("out_features")
        for x, y, o in zip(dataset.xs, dataset.ys, dataset.origins):
            _check_finite(x, f"{where}: {o.x}", o.first_row, "features")
            if not np.issubdtype(y.dtype, np.integer):
                _check_finite(y, f"{where}: {o.y}", o.first_row, "targets")
            elif classes is not None:
                _check_range(y, f"{where}: {o.y}", o.first_row, int(classes), "class id", "row")
    elif isinstance(dataset, TokenWindows) and spec.get("vocab_size"):
        for i, segment in enumerate(dataset.segments):
            name = f"{where}: token segment {i}"
            _check_range(segment, name, 0, int(spec["vocab_size"]), "token id", "position")


def _bad_rows(
    arr: np.ndarray,
    bad: Callable[[np.ndarray], np.ndarray],
    fine: Callable[[np.ndarray], bool] | None = None,
) -> tuple[int, int]:
    """The first row of `arr` where `bad` (element-wise) holds, and how many rows it holds in;
    (-1, 0) for none. Vectorised chunk by chunk: about 2 ms per 100k rows of 64 floats. `fine`:
    a cheaper whole-chunk test that skips the mask (the check runs at every data view)."""
    step = max(1, _CHECK_CHUNK_BYTES // max(arr[:1].nbytes, 1))
    first, count = -1, 0
    for lo in range(0, len(arr), step):
        chunk = arr[lo : lo + step]
        if fine is not None and fine(chunk):
            continue
        mask = bad(chunk)
        if not mask.any():
            continue
        rows = np.flatnonzero(mask.reshape(len(mask), -1).any(axis=1))
        first = lo + int(rows[0]) if first < 0 else first
        count += len(rows)
    return first, count


def _check_finite(arr: np.ndarray, name: str, first_row: int, what: str) -> None:
    if not np.issubdtype(arr.dtype, np.inexact):
        return  # integers and booleans are always finite
    row, count = _bad_rows(arr, lambda chunk: ~np.isfinite(chunk))
    if count:
        value = next(v for v in np.ravel(arr[row]) if not np.isfinite(v))
        value = "NaN" if np.isnan(value) else ("-inf" if value < 0 else "inf")
        more = f" (and {count - 1} more row(s))" if count > 1 else ""
        raise UserError(
            f"{name} row {first_row + row} has {value} in its {what}{more}: a model "
            "cannot learn from non-finite values; drop or fill those rows and rewrite it"
        )


def _check_range(
    arr: np.ndarray, name: str, first_row: int, limit: int, what: str, row_word: str
) -> None:
    key = "vocab_size" if what == "token id" else "out_features"
    row, count = _bad_rows(
        arr,
        lambda chunk: (chunk < 0) | (chunk >= limit),
        fine=lambda chunk: chunk.min() >= 0 and chunk.max() < limit,
    )
    if count:
        value = next(int(v) for v in np.ravel(arr[row]) if v < 0 or v >= limit)
        raise UserError(
            f"{name} {row_word} {first_row + row} has {what} {value}, outside 0..{limit - 1} "
            f"({key}={limit}): fix those rows, or the {key} the data source declares"
        )
