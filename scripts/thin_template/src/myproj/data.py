"""Where the rows come from: a generated classification set (nothing downloads).

A source meets the engine's `DataSource` contract: `num_rows(split)`, `load(split, ranges)`
and a `spec` the model is built from. `InMemoryArrays` does the first two for arrays held in
RAM; a source of yours only fills `arrays` and `spec`. For data on disk, subclass `DataSource`
and read only the requested row ranges in `load`, so that `sampler=sharded` holds each rank's
part only.
"""

from __future__ import annotations

import numpy as np
from hydra_ddp.api import InMemoryArrays, UserError

SPLITS = ("train", "val", "test")


class Blobs(InMemoryArrays):
    """`classes` Gaussian clusters in `features` dimensions, `rows` points in all, split
    train/val/test by `val_fraction` and `test_fraction` with a fixed `seed` (the same rows on
    every rank and at every resume). `spread` is each cluster's standard deviation: larger
    makes the classes overlap, and the task harder."""

    def __init__(
        self,
        rows: int,
        features: int,
        classes: int,
        spread: float,
        val_fraction: float,
        test_fraction: float,
        seed: int,
    ) -> None:
        if not (0 < val_fraction and 0 < test_fraction and val_fraction + test_fraction < 1):
            raise UserError(
                f"data.val_fraction={val_fraction}, data.test_fraction={test_fraction}: each "
                "must be > 0 and together < 1"
            )
        rng = np.random.default_rng(seed)
        centres = rng.normal(size=(classes, features)).astype(np.float32) * 2.0
        y = rng.integers(0, classes, size=rows)
        x = centres[y] + rng.normal(scale=spread, size=(rows, features)).astype(np.float32)
        order = rng.permutation(rows)
        n_val, n_test = int(rows * val_fraction), int(rows * test_fraction)
        cuts = np.split(order, [rows - n_val - n_test, rows - n_test])
        self.arrays = {s: (x[i], y[i].astype(np.int64)) for s, i in zip(SPLITS, cuts, strict=True)}
        self.spec = {"in_features": features, "out_features": classes}
