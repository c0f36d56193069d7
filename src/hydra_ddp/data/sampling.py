"""Memory-light samplers: one rank's batches of row indices, epoch by epoch, resumable mid-epoch.

``torch.utils.data.DistributedSampler`` materialises a full permutation of the dataset
(``torch.randperm(N).tolist()``) on every rank and every epoch: tens of bytes per row and
seconds of start-up for large N. Here each batch's indices are computed on demand from a keyed
pseudo-random bijection (`FeistelPermutation`), so memory is O(batch_size) and the first batch
comes at once, with ``DistributedSampler``'s partition (`StridedSampler`) or sampling only
rank-local rows (`ShardedSampler`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from torch.utils.data import Sampler

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MIX_MUL1 = 0xBF58476D1CE4E5B9
_MIX_MUL2 = 0x94D049BB133111EB
# Arbitrary non-zero start so that hashing the empty tuple and (0,) differ.
_COMBINE_INIT = 0x6A09E667F3BCC908

# Feistel rounds of every shuffled sampler order. The halves are narrow (3 bits at n = 64, 8 at
# 65536), and there fewer rounds are measurably not random: at 4, consecutive positions land
# on adjacent rows ~25 % more often than in a random permutation (`python
# tests/test_shuffle_quality.py` prints the table); 8 are indistinguishable from randperm.
# Changing the count changes every shuffled order, so a run resumed mid-epoch across such a
# change sees a different rest of that epoch.
FEISTEL_ROUNDS = 8
# Up to this domain size (n <= 2**16) a FeistelPermutation computes its whole table at first
# use: 1 MiB at most, built in about a millisecond.
_TABLE_MAX_DOMAIN = 1 << 16
# Distinct tags keep the per-epoch keys of the two samplers unrelated even for equal
# (seed, epoch), so switching sampler type never replays an order.
_TAG_STRIDED = 0x5354524944454421
_TAG_SHARDED = 0x5348415244454421
_CHUNK_INDICES = 1 << 16


def _splitmix64(x: int) -> int:
    """One step of the splitmix64 generator: a fast, well-mixing 64-bit hash."""
    return int(_mix64_inplace(np.array([(x + _GOLDEN_GAMMA) & _MASK64], dtype=np.uint64))[0])


def _combine(*parts: int) -> int:
    """Hash a sequence of integers (any sign, reduced mod 2**64) into one 64-bit key."""
    h = _COMBINE_INIT
    for part in parts:
        h = _splitmix64(h ^ (int(part) & _MASK64))
    return h


def _mix64_inplace(z: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array, in place (array integer ops wrap silently)."""
    z ^= z >> np.uint64(30)
    z *= np.uint64(_MIX_MUL1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(_MIX_MUL2)
    z ^= z >> np.uint64(31)
    return z


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class FeistelPermutation:
    """Keyed pseudo-random bijection of range(n) computed on demand in O(1) memory.

    A balanced Feistel network over the smallest even-bit-width domain ``2**(2h) >= n``
    (h >= 1), cycle-walking to stay inside ``[0, n)``; the round function is the splitmix64
    finaliser of ``right_half ^ round_key``. A Feistel network is a bijection for any round
    function, and cycle-walking a bijection of a superset restricted to ``[0, n)`` is again one.
    `n`: 1 to 2**63 - 1; `key`: any integer, reduced modulo 2**64.
    """

    def __init__(self, n: int, key: int, rounds: int = FEISTEL_ROUNDS) -> None:
        self.n = _check_int("n", n, 1)
        if self.n > np.iinfo(np.int64).max:
            raise ValueError(f"n must be <= 2**63 - 1, got {self.n}")
        self.rounds = _check_int("rounds", rounds, 1)
        self.key = int(key) & _MASK64
        # The smallest h >= 1 with 2**(2h) >= n (h >= 1: even n == 1 has two non-empty
        # halves); the domain is then < 4n for n >= 2, bounding the expected walk by 4 steps.
        half_bits = max(1, ((self.n - 1).bit_length() + 1) // 2)
        self.domain = 1 << (2 * half_bits)
        self._shift = np.uint64(half_bits)
        self._mask = np.uint64((1 << half_bits) - 1)
        self._n_u64 = np.uint64(self.n)
        state = self.key
        self._round_keys = []
        for _ in range(self.rounds):
            self._round_keys.append(np.uint64(_splitmix64(state)))
            state = (state + _GOLDEN_GAMMA) & _MASK64
        self._table: np.ndarray | None = None

    def _permute_domain(self, x: np.ndarray) -> np.ndarray:
        """Apply the Feistel network on the full ``2**(2h)`` domain to a uint64 array."""
        left = x >> self._shift
        right = x & self._mask
        for round_key in self._round_keys:
            f = right ^ round_key
            _mix64_inplace(f)
            f &= self._mask
            left ^= f
            left, right = right, left
        return (left << self._shift) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """Positions in ``[0, n)`` (an integer array, any shape) mapped to their permuted values,
        as int64 of the same shape; a ValueError for a position outside ``[0, n)``."""
        pos = np.asarray(positions)
        shape = pos.shape
        # Work on 1-d arrays: 0-d numpy arithmetic returns scalars, which warn
        # on the intended uint64 wrap-around.
        flat = np.ravel(pos)
        if flat.size == 0:
            return np.zeros(shape, dtype=np.int64)
        if not np.issubdtype(flat.dtype, np.integer):
            raise ValueError(f"positions must be an integer array, got dtype {flat.dtype}")
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi >= self.n:
            raise ValueError(f"positions must lie in [0, {self.n}), got range [{lo}, {hi}]")
        if self.domain <= _TABLE_MAX_DOMAIN:
            if self._table is None:
                self._table = self._whole_table()
            return self._table[flat].reshape(shape)
        out = self._permute_domain(flat.astype(np.uint64))
        return self._cycle_walk(out, self._permute_domain).reshape(shape)

    def _cycle_walk(self, out: np.ndarray, step: Any) -> np.ndarray:
        """Re-apply ``step`` to the entries of ``out`` outside ``[0, n)`` until all are inside.

        Terminates because the cycle through an in-range start contains an in-range element.
        """
        pending = np.flatnonzero(out >= self._n_u64)
        while pending.size:
            walked = step(out[pending])
            out[pending] = walked
            pending = pending[walked >= self._n_u64]
        return out.astype(np.int64)

    def _whole_table(self) -> np.ndarray:
        """The permutation of all of ``[0, n)`` as an array (small domains only).

        A cycle-walk step on an array costs some 40 numpy calls whatever its length, and a
        batch of a few dozen rows needs a dozen steps: as much as a small model's whole data
        path. Here the network runs once over the whole domain and each walk step is a table
        lookup; the result is the same bijection.
        """
        step = self._permute_domain(np.arange(self.domain, dtype=np.uint64))
        return self._cycle_walk(step[: self.n].copy(), step.__getitem__)


class EpochSampler(Sampler[np.ndarray]):
    """Batches of row indices for one rank, epoch by epoch, resumable mid-epoch: what a sampler
    policy's `sampler()` returns (the contract: `hydra_ddp.protocols.EpochSampler`). A subclass
    sets `num_samples` (this rank's rows per epoch, the same batch count on every rank) and
    `_domain` (the rows `_order(epoch)` permutes), and defines `_key(epoch)` and
    `_rows(sample_ids, order)` (this rank's i-th samples -> indices into the rows it loaded);
    epochs, batching, `drop_last` and the resume position are done here."""

    num_samples: int
    _domain: int

    def __init__(self, batch_size: int, drop_last: bool, shuffle: bool, seed: int) -> None:
        super().__init__()
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.drop_last = bool(drop_last)
        self.shuffle = bool(shuffle)
        self.seed = _check_int("seed", seed, -(1 << 63))
        self.epoch = 0
        self.start_batch = 0

    def _order(self, epoch: int) -> FeistelPermutation | None:
        """The epoch's permutation of the `_domain` rows (None: unshuffled), keyed by the
        subclass's `_key(epoch)`. FEISTEL_ROUNDS is read here, at call time, not bound at
        definition."""
        if not self.shuffle:
            return None
        return FeistelPermutation(self._domain, _combine(*self._key(epoch)), FEISTEL_ROUNDS)

    def _rows(self, sample_ids: np.ndarray, order: FeistelPermutation | None) -> np.ndarray:
        raise NotImplementedError

    def __len__(self) -> int:
        """Batches in a full epoch (whatever ``start_batch`` is)."""
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def __iter__(self) -> Iterator[np.ndarray]:
        """int64 row-index arrays, one per batch, from ``start_batch`` to the epoch's end; then
        the next epoch (the following ``iter`` reshuffles)."""
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
        """The whole epoch's row indices for this rank, as a full ``__iter__`` yields them
        (materialised: for tests, small data and the resume arithmetic)."""
        epoch = _check_int("epoch", epoch, 0)
        count = len(self) * self.batch_size if self.drop_last else self.num_samples
        return self._rows(np.arange(count, dtype=np.int64), self._order(epoch))

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (DistributedSampler's method); restarts it from batch 0."""
        self.epoch = _check_int("epoch", epoch, 0)
        self.start_batch = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "start_batch": self.start_batch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
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
    """DistributedSampler's partition without materialising N indices.

    Rank r's i-th sample is position ``r + i * world_size`` of a per-epoch order of
    ``range(num_rows)``: the identity without ``shuffle``, else a `FeistelPermutation` keyed by
    (seed, epoch), the same on every rank. Positions ``>= num_rows`` (DistributedSampler's
    padding) wrap to ``p % num_rows``, as its ``indices += indices[:padding]`` does.
    ``drop_last``: ``num_rows // world_size`` samples per rank and the last partial batch
    dropped; else ``ceil(num_rows / world_size)``. Unshuffled, the batches equal
    ``BatchSampler(DistributedSampler(..., shuffle=False, drop_last=d), batch_size, d)``.
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
    ) -> None:
        super().__init__(batch_size=batch_size, drop_last=drop_last, shuffle=shuffle, seed=seed)
        self.num_rows = self._domain = _check_int("num_rows", num_rows, 1)
        self.world_size = _check_int("world_size", world_size, 1)
        self.rank = _check_int("rank", rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank must be < world_size={self.world_size}, got {self.rank}")
        if self.drop_last and self.num_rows < self.world_size:
            raise ValueError(
                f"drop_last=True needs num_rows >= world_size, got num_rows={self.num_rows} "
                f"< world_size={self.world_size} (every rank would get 0 samples)"
            )
        if self.drop_last:
            self.num_samples = self.num_rows // self.world_size
        else:
            self.num_samples = -(-self.num_rows // self.world_size)

    def _key(self, epoch: int) -> tuple[int, ...]:
        return _TAG_STRIDED, self.seed, epoch

    def _rows(self, sample_ids: np.ndarray, order: FeistelPermutation | None) -> np.ndarray:
        positions = sample_ids * self.world_size + self.rank
        if self.num_samples * self.world_size > self.num_rows:  # padding wraps
            positions %= self.num_rows
        if order is None:
            return positions
        return order(positions)


class ShardedSampler(EpochSampler):
    """Samples only this rank's local rows ``0..local_rows-1`` (the dataset holds only them).

    Every epoch: a local permutation keyed by (seed, epoch, rank) (the identity without
    ``shuffle``), of which the first ``samples_per_epoch`` entries are used. That count must
    be the same on every rank (the min over ranks of their local rows), so that all ranks take
    the same number of steps; a bigger rank's other rows are skipped that epoch (other ones
    each epoch when shuffling; the tail when not).
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
        self.local_rows = self._domain = _check_int("local_rows", local_rows, 1)
        self.num_samples = _check_int("samples_per_epoch", samples_per_epoch, 1)
        if self.num_samples > self.local_rows:
            raise ValueError(
                f"samples_per_epoch={self.num_samples} exceeds local_rows={self.local_rows}; "
                "it must be the min over ranks of their local rows"
            )

    def _key(self, epoch: int) -> tuple[int, ...]:
        return _TAG_SHARDED, self.seed, epoch, self.rank

    def _rows(self, sample_ids: np.ndarray, order: FeistelPermutation | None) -> np.ndarray:
        if order is None:
            return sample_ids
        return order(sample_ids)
