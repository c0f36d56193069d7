"""Memory-light distributed samplers and row/file partitioning helpers.

``torch.utils.data.DistributedSampler`` materialises a full permutation of the
dataset (``torch.randperm(N).tolist()``) on every rank and every epoch, which
costs tens of bytes per row and seconds of start-up for large N.  The samplers
here compute each batch's indices on demand from a keyed pseudo-random
bijection (:class:`FeistelPermutation`), so memory is O(batch_size) and the
first batch is available immediately, while keeping ``DistributedSampler``'s
partition semantics (:class:`StridedSampler`) or sampling only rank-local rows
(:class:`ShardedSampler`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from hydra_ddp.data.permutation import (
    _TABLE_MAX_DOMAIN,  # noqa: F401  (tests read it here)
    FEISTEL_ROUNDS,
    FeistelPermutation,
    _check_int,
    _combine,
)

__all__ = [
    "FEISTEL_ROUNDS",
    "EpochSampler",
    "FeistelPermutation",
    "ShardedSampler",
    "StridedSampler",
    "partition_files",
    "partition_rows",
    "samples_per_epoch",
]

logger = logging.getLogger(__name__)

# Distinct tags keep the per-epoch keys of the two samplers unrelated even for
# equal (seed, epoch), so switching sampler type never replays an order.
_TAG_STRIDED = 0x5354524944454421
_TAG_SHARDED = 0x5348415244454421

_CHUNK_INDICES = 1 << 16


class EpochSampler(Sampler[np.ndarray]):
    """Batches of row indices for one rank, epoch by epoch, resumable mid-epoch: what a sampler
    policy's `sampler()` returns (the contract: `hydra_ddp.protocols.EpochSampler`). A subclass
    sets `num_samples` (this rank's rows per epoch, the
    same batch count on every rank) and defines `_order(epoch)` (a permutation, or None) and
    `_rows(sample_ids, order)` (this rank's i-th samples -> indices into the rows it loaded);
    epochs, batching, `drop_last` and the resume position are done here."""

    num_samples: int
    epoch: int
    start_batch: int

    def __init__(self, batch_size: int, drop_last: bool, shuffle: bool, seed: int) -> None:
        super().__init__()
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.drop_last = bool(drop_last)
        self.shuffle = bool(shuffle)
        self.seed = _check_int("seed", seed, -(1 << 63))
        self.epoch = 0
        self.start_batch = 0

    # -- subclass hooks -----------------------------------------------------
    def _order(self, epoch: int) -> FeistelPermutation | None:
        """The epoch's permutation of sample positions, or None for identity order."""
        raise NotImplementedError

    def _rows(self, sample_ids: np.ndarray, order: FeistelPermutation | None) -> np.ndarray:
        """Map this rank's sample ordinals (0..num_samples-1) to row indices."""
        raise NotImplementedError

    # -- public API -----------------------------------------------------------
    def __len__(self) -> int:
        """Number of batches in a full epoch (ignores ``start_batch``)."""
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def __iter__(self) -> Iterator[np.ndarray]:
        """Yield int64 row-index arrays, one per batch, from ``start_batch`` to the epoch's end.

        ``start_batch`` is advanced as batches are handed out, so ``state_dict``
        taken after consuming k batches resumes at batch k.  Running to
        completion moves to the next epoch so the following ``iter`` reshuffles.
        """
        epoch = self.epoch
        order = self._order(epoch)
        num_batches = len(self)
        batch, chunk = self.start_batch, 1
        while batch < num_batches:
            # Permute several batches per numpy call: a call costs ~0.1 ms whatever its size,
            # which would dominate small batches. The chunk starts at one batch (the first
            # index comes at once) and doubles up to ~64k indices (0.5 MiB: O(1) memory).
            count = min(chunk, num_batches - batch)
            start = batch * self.batch_size
            stop = min((batch + count) * self.batch_size, self.num_samples)
            rows = self._rows(np.arange(start, stop, dtype=np.int64), order)
            for i in range(count):
                # Set before yielding: once the consumer holds this batch it counts
                # as consumed for checkpointing purposes.
                self.start_batch = batch + i + 1
                yield rows[i * self.batch_size : (i + 1) * self.batch_size]
            batch += count
            chunk = min(2 * chunk, max(1, _CHUNK_INDICES // self.batch_size))
        self.epoch = epoch + 1
        self.start_batch = 0

    def indices(self, epoch: int) -> np.ndarray:
        """The whole epoch's row indices for this rank: the concatenation of a full ``__iter__``.

        With ``drop_last`` this excludes the dropped final partial batch.
        Materialises the epoch, so meant for tests and small data.
        """
        epoch = _check_int("epoch", epoch, 0)
        count = len(self) * self.batch_size if self.drop_last else self.num_samples
        return self._rows(np.arange(count, dtype=np.int64), self._order(epoch))

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (DistributedSampler compatibility); restarts it from batch 0."""
        self.epoch = _check_int("epoch", epoch, 0)
        self.start_batch = 0

    def state_dict(self) -> dict[str, int]:
        """Resume state: ``{"epoch": int, "start_batch": int}``."""
        return {"epoch": self.epoch, "start_batch": self.start_batch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``epoch`` and ``start_batch`` from :meth:`state_dict` output."""
        missing = {"epoch", "start_batch"} - set(state)
        if missing:
            raise ValueError(f"sampler state is missing keys {sorted(missing)}")
        epoch = _check_int("epoch", state["epoch"], 0)
        start_batch = _check_int("start_batch", state["start_batch"], 0)
        if start_batch > len(self):
            raise ValueError(
                f"start_batch={start_batch} exceeds the {len(self)} batches per epoch; "
                "was the state saved with a different dataset size, world size or batch size?"
            )
        self.epoch = epoch
        self.start_batch = start_batch


class StridedSampler(EpochSampler):
    """DistributedSampler's partition semantics without materialising N indices.

    Rank r's i-th sample is global position ``p = r + i * world_size`` of a
    per-epoch order of ``range(num_rows)``.  Positions ``>= num_rows`` (the
    padding DistributedSampler adds when not ``drop_last``) wrap to
    ``p % num_rows``, exactly like DistributedSampler's
    ``indices += indices[:padding]`` (repeating when padding > num_rows).
    The order is the identity if not ``shuffle``, else a
    :class:`FeistelPermutation` keyed by (seed, epoch), identical on all ranks.

    * ``drop_last=True``: ``num_samples = num_rows // world_size`` and the final
      partial batch is dropped too.
    * ``drop_last=False``: ``num_samples = ceil(num_rows / world_size)``; the
      final partial batch is kept.
    * ``pad=False`` (evaluation): positions ``>= num_rows`` are skipped instead of
      wrapped, so every row is seen exactly once across ranks and ranks may
      differ by one sample (``num_samples`` differs per rank; a rank with
      ``rank >= num_rows`` gets none).  Requires ``drop_last=False``.

    With ``shuffle=False`` the batches equal
    ``BatchSampler(DistributedSampler(..., shuffle=False, drop_last=d), batch_size, drop_last=d)``.
    With ``shuffle=True`` the partition structure is the same but the order is
    the Feistel one, not ``torch.randperm``'s.
    """

    def __init__(
        self,
        num_rows: int,
        rank: int,
        world_size: int,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        pad: bool = True,
    ) -> None:
        super().__init__(batch_size=batch_size, drop_last=drop_last, shuffle=shuffle, seed=seed)
        self.num_rows = _check_int("num_rows", num_rows, 1)
        self.world_size = _check_int("world_size", world_size, 1)
        self.rank = _check_int("rank", rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank must be < world_size={self.world_size}, got {self.rank}")
        self.pad = bool(pad)
        if not self.pad and self.drop_last:
            raise ValueError("pad=False requires drop_last=False")
        if self.drop_last and self.num_rows < self.world_size:
            raise ValueError(
                f"drop_last=True needs num_rows >= world_size, got num_rows={self.num_rows} "
                f"< world_size={self.world_size} (every rank would get 0 samples)"
            )
        if self.drop_last:
            self.num_samples = self.num_rows // self.world_size
        elif self.pad:
            self.num_samples = -(-self.num_rows // self.world_size)
        else:
            # Count of positions rank, rank+W, ... below num_rows.
            self.num_samples = max(0, -(-(self.num_rows - self.rank) // self.world_size))
        logger.debug(
            "StridedSampler(num_rows=%d, rank=%d/%d, batch_size=%d, shuffle=%s, drop_last=%s, "
            "pad=%s): %d samples, %d batches per epoch",
            self.num_rows,
            self.rank,
            self.world_size,
            self.batch_size,
            self.shuffle,
            self.drop_last,
            self.pad,
            self.num_samples,
            len(self),
        )

    def _order(self, epoch: int) -> FeistelPermutation | None:
        if not self.shuffle:
            return None
        # FEISTEL_ROUNDS is read here, at call time, not bound at definition.
        return FeistelPermutation(
            self.num_rows, _combine(_TAG_STRIDED, self.seed, epoch), rounds=FEISTEL_ROUNDS
        )

    def _rows(self, sample_ids: np.ndarray, order: FeistelPermutation | None) -> np.ndarray:
        positions = sample_ids * self.world_size + self.rank
        if self.pad and not self.drop_last and self.num_samples * self.world_size > self.num_rows:
            # Padding positions wrap; with pad=False or drop_last they never
            # reach num_rows by construction of num_samples.
            positions %= self.num_rows
        if order is None:
            return positions
        return order(positions)


class ShardedSampler(EpochSampler):
    """Samples only this rank's local rows ``0..local_rows-1`` (the dataset object holds only them).

    Every epoch: a local permutation keyed by (seed, epoch, rank) (identity if
    not ``shuffle``), of which only the first ``samples_per_epoch`` entries are
    used.  ``samples_per_epoch`` must be the same on every rank (the caller
    computes the min over ranks of local rows, see :func:`samples_per_epoch`)
    so that all ranks take the same number of steps; DDP hangs otherwise.
    Rows beyond ``samples_per_epoch`` on a bigger rank are skipped in that
    epoch (different ones each epoch when shuffling; always the tail when not).
    ``drop_last`` drops the final partial batch.
    """

    def __init__(
        self,
        local_rows: int,
        samples_per_epoch: int,
        rank: int,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(batch_size=batch_size, drop_last=drop_last, shuffle=shuffle, seed=seed)
        self.rank = _check_int("rank", rank, 0)
        self.local_rows = 0
        self.num_samples = 0
        self.resize(local_rows, samples_per_epoch)

    def resize(self, local_rows: int, samples_per_epoch: int) -> None:
        """Change the local row count and per-epoch sample count (e.g. when shards rotate).

        Keeps ``epoch`` and ``start_batch``: call between epochs, or before
        ``load_state_dict`` when resuming.
        """
        local_rows = _check_int("local_rows", local_rows, 1)
        spe = _check_int("samples_per_epoch", samples_per_epoch, 1)
        if spe > local_rows:
            raise ValueError(
                f"samples_per_epoch={spe} exceeds local_rows={local_rows}; "
                "it must be the min over ranks of their local rows"
            )
        self.local_rows = local_rows
        self.num_samples = spe
        logger.debug(
            "ShardedSampler(rank=%d): local_rows=%d, samples_per_epoch=%d, %d batches per epoch",
            self.rank,
            local_rows,
            spe,
            len(self),
        )

    @property
    def samples_per_epoch(self) -> int:
        """Samples this rank uses per epoch (same on every rank); alias of ``num_samples``."""
        return self.num_samples

    def _order(self, epoch: int) -> FeistelPermutation | None:
        if not self.shuffle:
            return None
        return FeistelPermutation(
            self.local_rows,
            _combine(_TAG_SHARDED, self.seed, epoch, self.rank),
            rounds=FEISTEL_ROUNDS,
        )

    def _rows(self, sample_ids: np.ndarray, order: FeistelPermutation | None) -> np.ndarray:
        if order is None:
            return sample_ids
        return order(sample_ids)


def partition_rows(
    num_rows: int, world_size: int, epoch: int = 0, rotate: bool = False
) -> list[list[tuple[int, int]]]:
    """Contiguous split of ``range(num_rows)`` over ranks.

    Part j is ``[j*n//W, (j+1)*n//W)``; rank r holds part r, or part
    ``(r + epoch) % W`` when ``rotate``.  Returns, per rank, a list of
    half-open row ranges (one range; empty list if the part is empty, which
    only happens when ``num_rows < world_size``).
    """
    n = _check_int("num_rows", num_rows, 1)
    w = _check_int("world_size", world_size, 1)
    epoch = _check_int("epoch", epoch, 0)
    result: list[list[tuple[int, int]]] = []
    for rank in range(w):
        part = (rank + epoch) % w if rotate else rank
        start, stop = part * n // w, (part + 1) * n // w
        result.append([(start, stop)] if stop > start else [])
    return result


def partition_files(
    file_rows: list[int], world_size: int, epoch: int = 0, rotate: bool = False
) -> list[list[tuple[int, int]]]:
    """Assign whole shard files to ranks, round-robin.

    File f goes to rank ``f % W``, or ``(f - epoch) % W`` when ``rotate``:
    rank r then holds the files ``f ≡ r + epoch (mod W)``, a different residue
    class each epoch (for W >= 2), so every rank's set changes every epoch and
    every file is held by exactly one rank per epoch.

    Returns, per rank, the global row ranges ``[offset_f, offset_f + rows_f)``
    of its files in file order (global row = cumulative rows of earlier files
    + row in file); files with zero rows contribute no range.

    Raises:
        ValueError: If there are fewer files than ranks (some rank would get no
            file), or if a row count or argument is invalid.
    """
    w = _check_int("world_size", world_size, 1)
    epoch = _check_int("epoch", epoch, 0)
    rows = [_check_int(f"file_rows[{i}]", r, 0) for i, r in enumerate(file_rows)]
    if len(rows) < w:
        raise ValueError(
            f"partition_files needs at least one file per rank: got {len(rows)} files for "
            f"world_size={w}; write more (smaller) shard files or use partition_rows"
        )
    result: list[list[tuple[int, int]]] = [[] for _ in range(w)]
    offset = 0
    for f, count in enumerate(rows):
        rank = (f - epoch) % w if rotate else f % w
        if count:
            result[rank].append((offset, offset + count))
        offset += count
    return result


def samples_per_epoch(rank_ranges: list[list[tuple[int, int]]]) -> int:
    """Min over ranks of the rows each holds: the number every rank uses per epoch."""
    if not rank_ranges:
        raise ValueError("rank_ranges must hold one list of ranges per rank, got an empty list")
    return min(sum(stop - start for start, stop in ranges) for ranges in rank_ranges)
