"""What a data source's `load` returns: rows held as arrays, indexed by whole index arrays.

`Rows` (x, y pairs, possibly several memory-mapped segments) and `TokenWindows` (a token
stream cut into windows) are the fast path: one vectorised gather per batch. `Origin` tells
an error message which file and row a segment came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from hydra_ddp.errors import UserError

# Half-open row ranges of a split, in order: what a rank loads.
SPLITS = ("train", "val", "test")


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
