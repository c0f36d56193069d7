"""Evaluation batches that line up across ranks, as accelerate's `even_batches` does.

Ranks evaluate uneven shares of a split (one row more or less, more with a policy's own
`eval_rank_ranges`), so they would hold different numbers of batches, and a loss or metric that
gathers (`all_gather_with_grad`, `gather_for_metrics`) would pair one rank's gather with another
rank's next collective: gloo aborts a rank, or the shapes read back are garbage. Here every rank
gets the same batches, batch i the same size on every rank. The batch boundaries are every multiple
of the batch size and every rank's row count, so each batch is, on each rank, either all real rows
or all padding: a padded batch repeats rows of the rank's own (the model sees real data) and counts
for nothing: its loss and sums are left out (loop/scoring.py), its predictions too
(loop/scoring.py), and `gather_for_metrics` leaves it out of what it gathers. Without uneven shares
nothing is padded and the batches are those of a plain sequential pass.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np


def boundaries(counts: list[int], batch_size: int) -> list[tuple[int, int]]:
    """The batches [start, stop) of local row positions every rank walks through: up to the
    largest count, cut at every multiple of `batch_size` and at every rank's count."""
    most = max(counts, default=0)
    cuts = set(range(batch_size, most, batch_size)) | {c for c in counts if 0 < c < most}
    edges = [0, *sorted(cuts), most] if most else [0]
    return list(zip(edges[:-1], edges[1:]))


class EvenBatches:
    """This rank's evaluation batches: index arrays into its loaded rows, one per shared batch.

    `indices`: the dataset index of each of this rank's real rows, in order; `counts`: every
    rank's number of real rows (each rank knows them all: the partition is deterministic).
    `padded[i]`: per rank, whether batch i is padding there."""

    def __init__(self, indices: np.ndarray, counts: list[int], rank: int, batch_size: int):
        self.indices = np.asarray(indices, dtype=np.int64)
        self.held = counts[rank]
        self.batches = boundaries(counts, batch_size)
        self.padded = [tuple(start >= c for c in counts) for start, _ in self.batches]
        self.rank = rank

    def is_padding(self, i: int) -> bool:
        return self.padded[i][self.rank]

    def positions(self, i: int) -> np.ndarray:
        """Local row positions of batch i (of its real rows; none for a padded batch)."""
        start, stop = self.batches[i]
        return np.arange(start, stop) if stop <= self.held else np.arange(0)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[np.ndarray]:
        for i, (start, stop) in enumerate(self.batches):
            if not self.is_padding(i):
                yield self.indices[start:stop]
            elif self.held:  # the rank's own rows again, as many as the batch needs
                yield self.indices[np.arange(stop - start) % self.held]
            else:  # a rank with no row of the split: its first loaded row (see EvalData)
                yield np.zeros(stop - start, dtype=np.int64)
