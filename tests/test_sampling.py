"""Tests for hydra_ddp.data.sampling: Feistel bijection, strided/sharded samplers, partitioning."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import numpy as np
import pytest
from helpers import ranks
from torch.utils.data import BatchSampler, DistributedSampler

from hydra_ddp.data import sampling
from hydra_ddp.data.policies import partition_files, partition_rows, samples_per_epoch
from hydra_ddp.data.sampling import FeistelPermutation, ShardedSampler, StridedSampler

WORLD_SIZES = [1, 2, 3, 4, 5]
SIZES = [1, 2, 3, 4, 7, 10, 17, 64, 101]


def _batches(sampler: StridedSampler | ShardedSampler) -> list[list[int]]:
    """One full iteration as plain lists (also advances the sampler's epoch)."""
    return [b.tolist() for b in sampler]


# --------------------------------------------------------------------------
# FeistelPermutation
# --------------------------------------------------------------------------

_SMALL_N = sorted(
    {1, 2, 3, 5, 7, 11, 13, 97, 101, 997}
    | {2**k for k in range(1, 13)}
    | {2**k - 1 for k in range(2, 13)}
    | {2**k + 1 for k in range(1, 13)}
)


@pytest.mark.parametrize("n", _SMALL_N)
def test_feistel_is_bijection_exhaustive(n: int) -> None:
    for key in (0, 1, 12345, -7, 2**64 - 1):
        out = FeistelPermutation(n, key)(np.arange(n, dtype=np.int64))
        assert out.dtype == np.int64
        assert np.array_equal(np.sort(out), np.arange(n))


@pytest.mark.parametrize("n", [1, 2, 3, 97, 1257, 4096, 4097, 2**16])
def test_feistel_table_equals_cycle_walk(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Small domains are served from a whole-epoch table; it must be the very same bijection
    # as the per-call cycle walk that large domains use (orders must not depend on n's size).
    rng = np.random.default_rng(n)
    for key in (0, 12345, 2**64 - 1):
        positions = rng.integers(0, n, size=min(n, 300))
        table = FeistelPermutation(n, key)
        assert table.domain <= sampling._TABLE_MAX_DOMAIN
        from_table = table(positions)
        monkeypatch.setattr(sampling, "_TABLE_MAX_DOMAIN", 0)
        walked = FeistelPermutation(n, key)(positions)
        monkeypatch.undo()
        assert from_table.dtype == walked.dtype == np.int64
        assert np.array_equal(from_table, walked)


@pytest.mark.parametrize("rounds", [1, 2, 3, 5, 8])
def test_feistel_bijection_other_round_counts(rounds: int) -> None:
    for n in (1, 6, 37, 1000):
        out = FeistelPermutation(n, 99, rounds=rounds)(np.arange(n))
        assert np.array_equal(np.sort(out), np.arange(n))


def test_feistel_large_n_sampled() -> None:
    n = 10**12 + 39
    perm = FeistelPermutation(n, 2024)
    rng = np.random.default_rng(0)
    pos = np.unique(rng.integers(0, n, size=200_000, dtype=np.int64))
    pos = np.concatenate([pos, [0, n - 1]])
    pos = np.unique(pos)
    out = perm(pos)
    assert out.min() >= 0 and out.max() < n
    # Injective on the sample: distinct inputs give distinct outputs.
    assert np.unique(out).size == pos.size
    # Deterministic and shape-preserving, element-wise consistent.
    assert np.array_equal(perm(pos[:10].reshape(2, 5)), out[:10].reshape(2, 5))
    assert int(perm(np.array(pos[3]))) == int(out[3])


def test_feistel_key_changes_order_and_looks_shuffled() -> None:
    n = 1000
    a = FeistelPermutation(n, 1)(np.arange(n))
    b = FeistelPermutation(n, 2)(np.arange(n))
    assert not np.array_equal(a, b)
    assert not np.array_equal(a, np.arange(n))
    # Weak uniformity check: where position 0 lands over many keys is spread out.
    n_small = 8
    hits = Counter(int(FeistelPermutation(n_small, k)(np.array([0]))[0]) for k in range(4000))
    assert set(hits) == set(range(n_small))
    assert min(hits.values()) > 4000 / n_small / 2


def test_feistel_rejects_bad_input() -> None:
    perm = FeistelPermutation(10, 0)
    with pytest.raises(ValueError):
        perm(np.array([10]))
    with pytest.raises(ValueError):
        perm(np.array([-1]))
    with pytest.raises(ValueError, match="n"):
        FeistelPermutation(0, 0)
    assert perm(np.array([], dtype=np.int64)).shape == (0,)


# --------------------------------------------------------------------------
# StridedSampler: partition properties
# --------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("shuffle", [False, True])
def test_strided_padded_partition(world_size: int, n: int, shuffle: bool) -> None:
    samplers = [
        StridedSampler(n, r, world_size, batch_size=3, shuffle=shuffle, seed=5)
        for r in range(world_size)
    ]
    per_rank = [s.indices(0) for s in samplers]
    expected_len = -(-n // world_size)
    assert all(len(ix) == expected_len for ix in per_rank)
    assert all(s.num_samples == expected_len for s in samplers)
    # Batches cover exactly the per-rank sequence (last partial batch kept).
    assert all(np.array_equal(np.concatenate(_batches(s)), ix) for s, ix in zip(samplers, per_rank))
    counts = Counter(np.concatenate(per_rank).tolist())
    assert set(counts) == set(range(n))  # complete
    padding = expected_len * world_size - n
    assert sum(counts.values()) == n + padding
    # Padding repeats the first `padding` positions of the order: every row
    # appears floor or ceil of total/n times, exactly like DistributedSampler.
    total = n + padding
    assert all(c in (total // n, -(-total // n)) for c in counts.values())


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("n", [5, 7, 10, 17, 64, 101])
def test_strided_drop_last_partition(world_size: int, n: int) -> None:
    if n < world_size:
        pytest.skip("drop_last needs n >= world_size")
    bs = 2
    samplers = [
        StridedSampler(n, r, world_size, batch_size=bs, shuffle=True, drop_last=True)
        for r in range(world_size)
    ]
    per_rank = [s.indices(0) for s in samplers]
    num_samples = n // world_size
    assert all(s.num_samples == num_samples for s in samplers)
    assert all(len(s) == num_samples // bs for s in samplers)
    assert all(len(ix) == (num_samples // bs) * bs for ix in per_rank)
    allix = np.concatenate(per_rank)
    assert len(np.unique(allix)) == len(allix)  # disjoint, no padding
    assert all(all(len(b) == bs for b in _batches(s)) for s in samplers)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_strided_equals_distributed_sampler_unshuffled(
    world_size: int, n: int, drop_last: bool, batch_size: int
) -> None:
    if drop_last and n < world_size:
        with pytest.raises(ValueError, match="num_rows"):
            StridedSampler(n, 0, world_size, batch_size, shuffle=False, drop_last=True)
        return
    for rank in range(world_size):
        ours = StridedSampler(n, rank, world_size, batch_size, shuffle=False, drop_last=drop_last)
        theirs = DistributedSampler(
            range(n), num_replicas=world_size, rank=rank, shuffle=False, drop_last=drop_last
        )
        assert ours.num_samples == theirs.num_samples
        # The standard torch pipeline: DataLoader(batch_size, drop_last) wraps
        # the DistributedSampler in a BatchSampler with the same drop_last.
        expected = list(BatchSampler(theirs, batch_size, drop_last))
        assert _batches(ours) == expected
        assert len(ours) == len(expected)
        if batch_size == 1:
            assert ours.indices(0).tolist() == list(theirs)


def test_strided_padding_larger_than_dataset_repeats() -> None:
    # n=2, W=5: DistributedSampler pads 3 > 2 rows by repeating the list.
    n, w = 2, 5
    ours = [StridedSampler(n, r, w, 1, shuffle=False).indices(0).tolist() for r in range(w)]
    theirs = [
        list(DistributedSampler(range(n), num_replicas=w, rank=r, shuffle=False)) for r in range(w)
    ]
    assert ours == theirs == [[0], [1], [0], [1], [0]]


def test_strided_shuffled_padding_repeats_order_prefix() -> None:
    # Shuffled padding must repeat the *permuted* order's head, like
    # DistributedSampler's indices += indices[:padding].
    n, w, seed = 10, 4, 3
    order = np.concatenate([StridedSampler(n, 0, 1, 1, shuffle=True, seed=seed).indices(2)] * 2)
    for r in range(w):
        got = StridedSampler(n, r, w, 2, shuffle=True, seed=seed).indices(2)
        assert got.tolist() == order[r:12:w].tolist()


def test_strided_same_seed_reproducible_and_rank_consistent() -> None:
    a = StridedSampler(1000, 1, 4, 32, seed=42)
    b = StridedSampler(1000, 1, 4, 32, seed=42)
    c = StridedSampler(1000, 1, 4, 32, seed=43)
    assert np.array_equal(a.indices(0), b.indices(0))
    assert not np.array_equal(a.indices(0), c.indices(0))
    # All ranks share one global order: rank r's sequence is its stride of rank 0 in a W=1 view.
    global_order = StridedSampler(1000, 0, 1, 32, seed=42).indices(0)
    for r in range(4):
        assert np.array_equal(
            StridedSampler(1000, r, 4, 32, seed=42).indices(0), global_order[r::4]
        )


def _orders(env, configs: list[tuple[int, ...]]) -> tuple[int, list[list[int]]]:
    """In a process of helpers/ranks.py: this interpreter's str hash and the samplers' orders."""
    out = [StridedSampler(n, r, w, b, seed=s).indices(e).tolist() for n, r, w, b, s, e in configs]
    out.append(ShardedSampler(50, 40, 2, 8, seed=9).indices(3).tolist())
    return hash("hydra-ddp"), out


def test_strided_identical_across_processes() -> None:
    configs = [(1000, 2, 4, 16, 7, 0), (101, 0, 3, 5, 0, 4), (17, 4, 5, 2, 123456789, 1)]
    # The other process hashes strings differently (its own PYTHONHASHSEED): that rules out any
    # dependence on Python's str/bytes hashing.
    [(their_hash, theirs)] = ranks.run(_orders, configs, world_size=1, group=False)
    assert their_hash != hash("hydra-ddp")
    here = [StridedSampler(n, r, w, b, seed=s).indices(e).tolist() for n, r, w, b, s, e in configs]
    here.append(ShardedSampler(50, 40, 2, 8, seed=9).indices(3).tolist())
    assert theirs == here


def _epoch_on_each_rank(env, n: int, batch_size: int, epoch: int) -> dict[str, list]:
    """Each rank's share of an epoch, as global row ids, gathered from every rank over gloo:
    the strided sampler's, and the sharded sampler's over its rank's part of the rows."""
    import torch.distributed as dist

    strided = StridedSampler(n, env.rank, env.world_size, batch_size, seed=3)
    strided.set_epoch(epoch)
    parts = partition_rows(n, env.world_size, epoch, rotate=True)
    ranges = parts[env.rank]
    offsets = np.concatenate([np.arange(a, b) for a, b in ranges])
    sharded = ShardedSampler(len(offsets), samples_per_epoch(parts), env.rank, batch_size, seed=3)
    sharded.set_epoch(epoch)
    mine = {
        "strided": [b.tolist() for b in strided],
        "sharded": [offsets[b].tolist() for b in sharded],
    }
    everyone: list = [None] * env.world_size
    dist.all_gather_object(everyone, mine)
    return {kind: [r[kind] for r in everyone] for kind in mine}


def test_ranks_partition_an_epoch_between_them() -> None:
    """On 2 real gloo ranks (101 rows: one padded): every rank gathers the same shares; the
    ranks take the same number of batches (DDP hangs otherwise); strided shares are disjoint
    apart from padding, cover the rows, and are each rank's stride of the one global order;
    sharded ones are disjoint."""
    n, bs, epoch, world_size = 101, 8, 2, 2
    done = ranks.run(_epoch_on_each_rank, n, bs, epoch, world_size=world_size)
    assert all(r == done[0] for r in done)  # all ranks agree on what every rank holds
    strided, sharded = done[0]["strided"], done[0]["sharded"]
    for shares in (strided, sharded):
        assert len({len(batches) for batches in shares}) == 1
    flat = [np.concatenate(batches) for batches in strided]
    rows = np.concatenate(flat)
    assert set(rows.tolist()) == set(range(n)) and len(rows) == -(-n // world_size) * world_size
    order = StridedSampler(n, 0, 1, bs, seed=3).indices(epoch)
    order = np.concatenate([order, order[: len(rows) - n]])  # the padding repeats the head
    for rank, share in enumerate(flat):
        assert np.array_equal(share, order[rank::world_size])
    seen = [row for batches in sharded for batch in batches for row in batch]
    assert len(seen) == len(set(seen))


def test_strided_epochs_differ_and_iteration_advances_epoch() -> None:
    s = StridedSampler(500, 1, 3, 16, seed=0)
    assert s.epoch == 0
    e0 = np.concatenate(_batches(s))
    assert s.epoch == 1 and s.start_batch == 0
    e1 = np.concatenate(_batches(s))
    assert s.epoch == 2
    assert np.array_equal(e0, s.indices(0)) and np.array_equal(e1, s.indices(1))
    assert not np.array_equal(e0, e1)
    # Each epoch is still a complete cover (500 rows + 1 padding row over 3 ranks).
    for epoch in (0, 1):
        full = np.concatenate([StridedSampler(500, r, 3, 16).indices(epoch) for r in range(3)])
        assert len(full) == 501 and np.array_equal(np.unique(full), np.arange(500))
    # set_epoch is honoured and resets start_batch.
    s.start_batch = 5
    s.set_epoch(0)
    assert s.state_dict() == {"epoch": 0, "start_batch": 0}
    assert np.array_equal(np.concatenate(_batches(s)), e0)


def test_strided_unshuffled_same_every_epoch() -> None:
    s = StridedSampler(20, 1, 3, 4, shuffle=False)
    assert np.array_equal(s.indices(0), s.indices(7))


def test_batches_are_int64_arrays() -> None:
    for s in (StridedSampler(100, 0, 2, 7), ShardedSampler(100, 60, 0, 7)):
        for b in s:
            assert isinstance(b, np.ndarray) and b.dtype == np.int64 and b.ndim == 1
            assert 1 <= len(b) <= 7


@pytest.mark.parametrize("k", [0, 1, 3, 6, 7])
@pytest.mark.parametrize("kind", ["strided", "sharded"])
def test_resume_mid_epoch(k: int, kind: str) -> None:
    def make() -> StridedSampler | ShardedSampler:
        if kind == "strided":
            return StridedSampler(97, 2, 3, 5, seed=11)  # 33 samples -> 7 batches
        return ShardedSampler(40, 33, 1, 5, seed=11)

    reference = make()
    reference.set_epoch(2)
    uninterrupted = _batches(reference)
    assert len(uninterrupted) == 7

    first = make()
    first.set_epoch(2)
    it = iter(first)
    consumed = [next(it).tolist() for _ in range(k)]
    state = first.state_dict()
    assert state == {"epoch": 2, "start_batch": k}

    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives serialisation
    assert len(resumed) == 7  # __len__ ignores start_batch
    rest = _batches(resumed)
    assert consumed + rest == uninterrupted
    assert resumed.state_dict() == {"epoch": 3, "start_batch": 0}


def test_load_state_dict_validation() -> None:
    s = StridedSampler(10, 0, 1, 5)
    with pytest.raises(ValueError, match="start_batch"):
        s.load_state_dict({"epoch": 0, "start_batch": 3})
    with pytest.raises(ValueError, match="missing"):
        s.load_state_dict({"epoch": 0})
    s.load_state_dict({"epoch": 4, "start_batch": 2})
    assert list(s) == [] and s.state_dict() == {"epoch": 5, "start_batch": 0}


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_rows": 0, "rank": 0, "world_size": 1, "batch_size": 1}, "num_rows"),
        ({"num_rows": 5, "rank": -1, "world_size": 2, "batch_size": 1}, "rank"),
        ({"num_rows": 5, "rank": 2, "world_size": 2, "batch_size": 1}, "rank"),
        ({"num_rows": 5, "rank": 0, "world_size": 0, "batch_size": 1}, "world_size"),
        ({"num_rows": 5, "rank": 0, "world_size": 2, "batch_size": 0}, "batch_size"),
        (
            {"num_rows": 2, "rank": 0, "world_size": 3, "batch_size": 1, "drop_last": True},
            "num_rows",
        ),
    ],
)
def test_strided_validation(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        StridedSampler(**kwargs)


def test_strided_large_n_first_batch_is_cheap() -> None:
    s = StridedSampler(10**11, 3, 8, 1024, seed=1)
    b = next(iter(s))
    assert len(b) == 1024 and b.min() >= 0 and b.max() < 10**11 and np.unique(b).size == 1024


# --------------------------------------------------------------------------
# ShardedSampler
# --------------------------------------------------------------------------


def test_sharded_uneven_ranks_same_batch_count_local_indices_only() -> None:
    local = [103, 97, 120, 99]
    spe = min(local)
    for drop_last in (False, True):
        samplers = [
            ShardedSampler(m, spe, r, 8, seed=3, drop_last=drop_last) for r, m in enumerate(local)
        ]
        batch_counts = set()
        for s, m in zip(samplers, local):
            batches = _batches(s)
            batch_counts.add(len(batches))
            assert len(batches) == len(s)
            flat = np.concatenate(batches)
            assert flat.min() >= 0 and flat.max() < m
            assert len(np.unique(flat)) == len(flat)  # no repeats within an epoch
            assert len(flat) == ((spe // 8) * 8 if drop_last else spe)
            if drop_last:
                assert all(len(b) == 8 for b in batches)
        assert len(batch_counts) == 1


def test_sharded_order_differs_per_epoch_and_rank() -> None:
    a0 = ShardedSampler(64, 64, 0, 8, seed=1)
    a1 = ShardedSampler(64, 64, 1, 8, seed=1)
    assert not np.array_equal(a0.indices(0), a0.indices(1))
    assert not np.array_equal(a0.indices(0), a1.indices(0))
    assert np.array_equal(np.sort(a0.indices(0)), np.arange(64))
    # Auto-advance gives the next epoch's order.
    assert np.array_equal(np.concatenate(_batches(a0)), a0.indices(0))
    assert a0.epoch == 1
    assert np.array_equal(np.concatenate(_batches(a0)), a0.indices(1))


def test_sharded_skips_different_rows_each_epoch() -> None:
    s = ShardedSampler(100, 60, 0, 10, seed=0)
    seen = [set(s.indices(e).tolist()) for e in range(10)]
    assert all(len(x) == 60 for x in seen)
    assert len({frozenset(x) for x in seen}) == 10
    # Each row is skipped with probability 0.4 per epoch, so over 10 epochs
    # all are expected to show up (deterministic for this seed).
    assert set().union(*seen) == set(range(100))
    # Unshuffled: always the first samples_per_epoch rows, in order.
    u = ShardedSampler(100, 60, 0, 10, shuffle=False)
    assert u.indices(0).tolist() == list(range(60)) == u.indices(5).tolist()


def test_sharded_sizes_and_validation() -> None:
    assert len(ShardedSampler(50, 40, 0, 16)) == 3
    s = ShardedSampler(30, 25, 0, 16)
    assert s.num_samples == 25 and len(s) == 2
    flat = np.concatenate(_batches(s))
    assert flat.max() < 30 and len(flat) == 25
    with pytest.raises(ValueError, match="samples_per_epoch"):
        ShardedSampler(10, 11, 0, 16)
    with pytest.raises(ValueError, match="local_rows"):
        ShardedSampler(0, 0, 0, 1)
    with pytest.raises(ValueError, match="rank"):
        ShardedSampler(5, 5, -1, 1)
    with pytest.raises(ValueError, match="batch_size"):
        ShardedSampler(5, 5, 0, 0)


# --------------------------------------------------------------------------
# partition_rows / partition_files / samples_per_epoch
# --------------------------------------------------------------------------


def _covered(parts: list[list[tuple[int, int]]]) -> list[int]:
    return sorted(i for ranges in parts for a, b in ranges for i in range(a, b))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("n", [1, 3, 10, 101])
def test_partition_rows_cover_and_rotation(world_size: int, n: int) -> None:
    prev = None
    for epoch in range(2 * world_size):
        parts = partition_rows(n, world_size, epoch, rotate=True)
        assert len(parts) == world_size
        assert _covered(parts) == list(range(n))  # disjoint and complete
        if prev is not None and world_size > 1 and n >= world_size:
            assert all(p != q for p, q in zip(parts, prev))
        prev = parts
    static = [partition_rows(n, world_size, e) for e in range(3)]
    assert static[0] == static[1] == static[2]
    if n >= world_size:
        assert static[0][0] == [(0, n // world_size)]
    sizes = [sum(b - a for a, b in r) for r in static[0]]
    assert max(sizes) - min(sizes) <= 1
    assert samples_per_epoch(static[0]) == n // world_size


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_partition_files_cover_and_rotation(world_size: int) -> None:
    file_rows = [5, 0, 7, 3, 11, 2, 9, 4, 6, 1, 8][: max(world_size, 7) + world_size % 3]
    offsets = np.concatenate([[0], np.cumsum(file_rows)])
    prev = None
    for epoch in range(2 * world_size):
        parts = partition_files(file_rows, world_size, epoch, rotate=True)
        assert len(parts) == world_size
        assert _covered(parts) == list(range(int(offsets[-1])))
        # Ranges are whole files.
        file_ranges = {
            (int(offsets[f]), int(offsets[f + 1])) for f in range(len(file_rows)) if file_rows[f]
        }
        assert all(r in file_ranges for ranges in parts for r in ranges)
        if prev is not None and world_size > 1:
            assert all(p != q for p, q in zip(parts, prev))
        prev = parts
    static = [partition_files(file_rows, world_size, e) for e in range(3)]
    assert static[0] == static[1] == static[2]
    assert samples_per_epoch(static[0]) == min(sum(b - a for a, b in r) for r in static[0])


def test_partition_files_round_robin_rule() -> None:
    parts = partition_files([10, 20, 30, 40], 2, epoch=1, rotate=True)
    # File f -> rank (f - 1) % 2: rank 0 gets files 1, 3; rank 1 gets 0, 2.
    assert parts == [[(10, 30), (60, 100)], [(0, 10), (30, 60)]]
    assert samples_per_epoch(parts) == 40


def test_partition_files_too_few_files() -> None:
    with pytest.raises(ValueError, match="at least one file per rank"):
        partition_files([100, 100], 3)


def test_partition_validation() -> None:
    with pytest.raises(ValueError, match="num_rows"):
        partition_rows(0, 2)
    with pytest.raises(ValueError, match="world_size"):
        partition_rows(10, 0)
    with pytest.raises(ValueError, match="file_rows"):
        partition_files([3, -1], 1)


def test_sharded_end_to_end_with_partitions() -> None:
    # Rotating file shards: each rank's sampler resized per epoch; all ranks step equally.
    file_rows = [13, 8, 21, 5, 17]
    w = 2
    for epoch in range(3):
        parts = partition_files(file_rows, w, epoch, rotate=True)
        spe = samples_per_epoch(parts)
        lens = set()
        for rank, ranges in enumerate(parts):
            local = sum(b - a for a, b in ranges)
            s = ShardedSampler(local, spe, rank, 4, seed=0)
            s.set_epoch(epoch)
            lens.add(len(list(itertools.islice(iter(s), 1000))))
        assert len(lens) == 1


def test_a_policy_argument_out_of_range_is_refused_naming_its_key() -> None:
    from helpers.inproc import typed

    from hydra_ddp.data import Digits, check_sampling
    from hydra_ddp.errors import UserError

    cfg = typed("sampler=sharded", "sampler.shard_by=pages")
    source = Digits(0.15, 0.15, 0)
    with pytest.raises(
        UserError, match=r"sampler\.shard_by='pages' is not allowed: .*rows or files"
    ):
        check_sampling(source, cfg.sampler, 2, 64)


@pytest.mark.parametrize(
    "override", ["sampler.shuffle=no", "sampler.drop_last=off", "sampler.rotate=yes"]
)
def test_a_switch_given_as_text_is_refused_not_read_as_on(override: str) -> None:
    """Hydra reads `no`, `off` and `yes` as text, and `bool("no")` is True: the switch would
    have been on whatever was meant."""
    from helpers.inproc import typed

    from hydra_ddp.data import Digits, check_sampling
    from hydra_ddp.errors import UserError

    key, value = override.split("=")
    cfg = typed("sampler=sharded", override)
    with pytest.raises(UserError) as info:
        check_sampling(Digits(0.15, 0.15, 0), cfg.sampler, 2, 64)
    assert str(info.value).startswith(f"{key}='{value}' is not allowed: ")
    assert str(info.value).endswith(f"takes {key.split('.')[1]}: bool (give true or false)")


def test_a_target_that_is_no_policy_is_refused_in_one_line() -> None:
    from hydra_ddp.data.policies import build_policy
    from hydra_ddp.errors import UserError

    with pytest.raises(UserError, match=r"sampler\._target_ built a Counter, not a sampler policy"):
        build_policy({"_target_": "collections.Counter"}, 0)


def test_a_policy_with_the_old_method_names_is_refused_in_one_line() -> None:
    from hydra_ddp.data.policies import Strided, build_policy
    from hydra_ddp.errors import UserError

    class OldNames(Strided):  # a policy written against parts() / eval_parts()
        def parts(self, num_rows, file_rows, world, epoch):
            return None

    with pytest.raises(UserError, match=r"OldNames defines parts\(\): these are now rank_ranges"):
        build_policy(OldNames(shuffle=False, seed=None, drop_last=False), 0)
    assert build_policy(Strided(shuffle=False, seed=None, drop_last=False), 3).seed == 3
