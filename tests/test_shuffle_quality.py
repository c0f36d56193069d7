"""Statistical quality of the samplers' shuffled orders, against ``torch.randperm``.

With 4 Feistel rounds the order is measurably non-random. Reproduction and
before/after (``python tests/test_shuffle_quality.py``; sampler seed 0 through
``StridedSampler(n, 0, 1, ...).indices(epoch)`` for epochs 0..E-1, i.e. the real per-epoch
key schedule; ``torch.randperm`` with a generator seeded 0; z against the random-permutation
distribution; "adjacent pairs" is the rate of ``|p[i] - p[i+1]| == 1`` over random's 2/n)::

    order         n      E  p0,p1 adjacent    adjacent pairs    serial corr (z)  max chi z
    randperm     64  20000   3.15 % ( +0.2)   0.997 x ( -0.7)   -0.01599 (-0.1)   0.9
    4 rounds     64  20000   4.67 % (+12.6)   1.224 x (+44.4)   -0.01590 (-0.0)   2.3
    6 rounds     64  20000   3.38 % ( +2.1)   1.033 x ( +6.6)   -0.01529 (+0.7)   2.7
    8 rounds     64  20000   3.19 % ( +0.6)   1.010 x ( +2.0)   -0.01578 (+0.1)   1.8
    randperm   1000   2000                    0.988 x ( -0.8)   -0.00190 (-1.3)   1.8
    4 rounds   1000   2000                    1.251 x (+15.9)   -0.00073 (+0.4)   1.8
    6 rounds   1000   2000                    1.035 x ( +2.2)   -0.00011 (+1.3)   1.9
    8 rounds   1000   2000                    1.021 x ( +1.3)   -0.00041 (+0.8)   2.1
    randperm   4096   1000                    1.044 x ( +2.0)   -0.00047 (-0.4)   2.2
    4 rounds   4096   1000                    1.311 x (+13.9)   -0.00001 (+0.5)   1.2
    6 rounds   4096   1000                    1.025 x ( +1.1)   -0.00110 (-1.7)   1.4
    8 rounds   4096   1000                    1.022 x ( +1.0)   -0.00054 (-0.6)   1.5
    randperm  65536    300                    1.038 x ( +0.9)   -0.00008 (-0.3)   1.6
    4 rounds  65536    300                    1.462 x (+11.3)   +0.00027 (+1.3)   1.3
    6 rounds  65536    300                    1.002 x ( +0.0)   -0.00010 (-0.4)   1.0
    8 rounds  65536    300                    1.087 x ( +2.1)   +0.00011 (+0.5)   2.6

Longer runs (a vectorised copy of the same network and keys) agree: at n = 64 over 100,000
epochs 6 rounds still give 1.027 x (z +12) and 8 rounds 1.004 x (z +1.7); over sampler seeds
1-6 (20,000 epochs each) 6 rounds give z +4.7 to +6.6 and 8 rounds |z| <= 1.1. Hence
``sampling.FEISTEL_ROUNDS = 8``.

Checks, each against the random-permutation distribution with |z| < 4.5 (two-sided normal
p ~ 7e-6; the chi-square via the Wilson-Hilferty transform to a z):

* position uniformity: for positions 0, 1, n/2, n-1, chi-square of which row (n <= 64) or
  which of 64 equal row bins lands there, over E epochs;
* first two rows adjacent, ``|p[0] - p[1]| == 1``: Binomial(E, 2/n) (n = 64 only; at large n
  the expected count is below 1);
* adjacent pairs along the epoch, ``|p[i] - p[i+1]| == 1`` for all i: about Poisson(2) per
  epoch (rate 2/n per pair);
* serial correlation: mean over epochs of Pearson(p[:-1], p[1:]), null mean -1/(n-1) and
  standard deviation 1/sqrt(n-1) per epoch.

The tests use 16,000 epochs at n = 64, 1,000 at 4096 and 200 at 65536. With 4 rounds the
adjacency checks fail (5 tests, z +11 to +40); with 6 rounds the n = 64 one fails (z +5.7);
with 8 all pass (|z| <= 2.4). Position uniformity and serial correlation pass at every round
count: the non-randomness is local (consecutive positions land on neighbouring rows).
Everything is seeded, so the outcome is fixed; the margins are wide both ways.
"""

from __future__ import annotations

import functools
import math
import sys
import timeit
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from hydra_ddp.data import sampling
from hydra_ddp.data.sampling import FeistelPermutation, ShardedSampler, StridedSampler

# Seconds of statistics over thousands of epochs, for a part that seldom changes: CI runs them
# (pytest -m slow); test_sampling.py keeps the quick checks of the orders in the default suite.
pytestmark = pytest.mark.slow
Z_MAX = 4.5
# Epochs per size in the tests: enough that 4 rounds fail every adjacency check by a wide
# margin (z >= 11), few enough for a few seconds in all.
EPOCHS = {64: 16_000, 4096: 1_000, 65536: 200}
# torch.randperm(65536) costs ~8 ms, so the control uses fewer epochs there.
RANDPERM_EPOCHS = {64: 16_000, 4096: 1_000, 65536: 50}
# The printed table (python tests/test_shuffle_quality.py): 20,000 epochs at n = 64.
TABLE_EPOCHS = {64: 20_000, 1000: 2_000, 4096: 1_000, 65536: 300}
_BLOCK = 1 << 18  # elements per vectorised block of epochs
_CHI_BINS = 64


@dataclass(frozen=True)
class Stat:
    """A statistic's value, its expectation for a random permutation, and the z-score."""

    value: float
    expected: float
    z: float

    def __str__(self) -> str:
        return f"{self.value:.4g} (expected {self.expected:.4g}, z={self.z:+.1f})"


def _chi2_z(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson chi-square of counts, as a standard normal z (Wilson-Hilferty)."""
    x2 = float(((observed - expected) ** 2 / expected).sum())
    k = observed.size - 1
    return ((x2 / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))


def shuffle_stats(blocks: Iterator[np.ndarray], n: int) -> dict[str, Stat | list[Stat]]:
    """Shuffle statistics of whole epochs, fed as (epochs, n) blocks of permutations of range(n).

    Returns ``first_two_adjacent`` (rate of ``|p[0]-p[1]| == 1``), ``adjacent_pairs`` (rate of
    ``|p[i]-p[i+1]| == 1`` relative to random's 2/n), ``serial_corr`` (mean per-epoch Pearson of
    p[i], p[i+1]) and ``position_chi2`` (one Stat per position in 0, 1, n/2, n-1: the chi-square
    statistic of the row, or row bin, landing there).
    """
    positions = sorted({0, 1, n // 2, n - 1})
    bins = min(n, _CHI_BINS)
    bin_size = np.bincount(np.arange(n) * bins // n, minlength=bins)
    hits = np.zeros((len(positions), bins), dtype=np.int64)
    epochs = first_two = adjacent = 0
    corr_sum = 0.0
    for block in blocks:
        epochs += block.shape[0]
        for j, pos in enumerate(positions):
            hits[j] += np.bincount(block[:, pos] * bins // n, minlength=bins)
        step = np.abs(np.diff(block, axis=1)) == 1
        first_two += int(step[:, 0].sum())
        adjacent += int(step.sum())
        x = block[:, :-1].astype(np.float64)
        y = block[:, 1:].astype(np.float64)
        x -= x.mean(axis=1, keepdims=True)
        y -= y.mean(axis=1, keepdims=True)
        corr_sum += float(((x * y).sum(1) / np.sqrt((x * x).sum(1) * (y * y).sum(1))).sum())
    p = 2 / n
    pairs = epochs * (n - 1)
    corr = corr_sum / epochs
    corr_null = -1 / (n - 1)
    expected_hits = epochs * bin_size / n
    return {
        "first_two_adjacent": Stat(
            first_two / epochs, p, (first_two - epochs * p) / math.sqrt(epochs * p * (1 - p))
        ),
        # Per epoch the count is close to Poisson(2); its variance is a little below the mean,
        # so the Poisson z is slightly conservative.
        "adjacent_pairs": Stat(
            adjacent / (pairs * p), 1.0, (adjacent - pairs * p) / math.sqrt(pairs * p)
        ),
        "serial_corr": Stat(corr, corr_null, (corr - corr_null) * math.sqrt((n - 1) * epochs)),
        "position_chi2": [
            Stat(
                float(((h - expected_hits) ** 2 / expected_hits).sum()),
                bins - 1,
                _chi2_z(h, expected_hits),
            )
            for h in hits
        ],
    }


def _blocks(epoch_order: Callable[[int], np.ndarray], n: int, epochs: int) -> Iterator[np.ndarray]:
    per_block = max(1, _BLOCK // n)
    for start in range(0, epochs, per_block):
        yield np.stack([epoch_order(e) for e in range(start, min(epochs, start + per_block))])


def sampler_stats(
    n: int, epochs: int, kind: str = "strided", seed: int = 0
) -> dict[str, Stat | list[Stat]]:
    """Statistics of a shuffled sampler's real epochs 0..epochs-1 (one rank holding all rows)."""
    if kind == "strided":
        sampler = StridedSampler(n, 0, 1, batch_size=n, shuffle=True, seed=seed)
    else:
        sampler = ShardedSampler(n, n, 0, batch_size=n, shuffle=True, seed=seed)
    return shuffle_stats(_blocks(sampler.indices, n, epochs), n)


def randperm_stats(n: int, epochs: int, seed: int = 0) -> dict[str, Stat | list[Stat]]:
    """The same statistics for torch.randperm with a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return shuffle_stats(_blocks(lambda _: torch.randperm(n, generator=gen).numpy(), n, epochs), n)


@functools.cache
def _cached(family: str, n: int, rounds: int) -> dict[str, Stat | list[Stat]]:
    """Cache per (family, n, rounds): several tests read one computation."""
    if family == "randperm":
        return randperm_stats(n, RANDPERM_EPOCHS[n])
    return sampler_stats(n, EPOCHS[n], kind=family)


def _stats(family: str, n: int) -> dict[str, Stat | list[Stat]]:
    return _cached(family, n, sampling.FEISTEL_ROUNDS)


def _report(stats: dict[str, Stat | list[Stat]]) -> str:
    lines = []
    for name, value in stats.items():
        if isinstance(value, list):
            value = ", ".join(f"z={s.z:+.1f}" for s in value)
        lines.append(f"  {name}: {value}")
    return f"(FEISTEL_ROUNDS={sampling.FEISTEL_ROUNDS})\n" + "\n".join(lines)


# --------------------------------------------------------------------------
# The sampler's orders
# --------------------------------------------------------------------------


def test_samplers_use_feistel_rounds() -> None:
    assert FeistelPermutation(10, 0).rounds == sampling.FEISTEL_ROUNDS
    assert StridedSampler(10, 0, 1, 2)._order(0).rounds == sampling.FEISTEL_ROUNDS
    assert ShardedSampler(10, 10, 0, 2)._order(0).rounds == sampling.FEISTEL_ROUNDS


@pytest.mark.parametrize("n", sorted(EPOCHS))
def test_position_uniformity(n: int) -> None:
    stats = _stats("strided", n)
    assert all(abs(s.z) < Z_MAX for s in stats["position_chi2"]), _report(stats)


def test_first_two_rows_adjacency() -> None:
    # With 4 rounds: 4.7 % against 3.1 %.
    stats = _stats("strided", 64)
    assert abs(stats["first_two_adjacent"].z) < Z_MAX, _report(stats)


@pytest.mark.parametrize("n", sorted(EPOCHS))
def test_adjacent_pairs_along_epoch(n: int) -> None:
    stats = _stats("strided", n)
    assert abs(stats["adjacent_pairs"].z) < Z_MAX, _report(stats)


@pytest.mark.parametrize("n", sorted(EPOCHS))
def test_serial_correlation(n: int) -> None:
    stats = _stats("strided", n)
    assert abs(stats["serial_corr"].z) < Z_MAX, _report(stats)


def test_sharded_sampler_adjacent_pairs() -> None:
    # ShardedSampler has its own key schedule (seed, epoch, rank); same network.
    stats = _stats("sharded", 4096)
    assert abs(stats["adjacent_pairs"].z) < Z_MAX, _report(stats)


# --------------------------------------------------------------------------
# Control: torch.randperm passes the same checks (the nulls are right)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("n", sorted(RANDPERM_EPOCHS))
def test_randperm_passes_the_same_checks(n: int) -> None:
    stats = _stats("randperm", n)
    zs = [s.z for s in stats["position_chi2"]]
    zs += [stats["adjacent_pairs"].z, stats["serial_corr"].z]
    if n == 64:
        zs.append(stats["first_two_adjacent"].z)
    assert all(abs(z) < Z_MAX for z in zs), _report(stats)


# --------------------------------------------------------------------------
# python tests/test_shuffle_quality.py: the before/after table and the cost
# --------------------------------------------------------------------------


def _row(label: str, n: int, epochs: int, stats: dict[str, Stat | list[Stat]]) -> str:
    f2, adj, corr = stats["first_two_adjacent"], stats["adjacent_pairs"], stats["serial_corr"]
    first = f"{100 * f2.value:5.2f} % ({f2.z:+5.1f})" if n <= 64 else " " * 16
    chi = max(abs(s.z) for s in stats["position_chi2"])
    return (
        f"| {label:9} | {n:6} | {epochs:6} | {first} | {adj.value:6.3f} x ({adj.z:+5.1f}) "
        f"| {corr.value:+.5f} ({corr.z:+4.1f}) | {chi:4.1f} |"
    )


def _best_us(fn: Callable[[], object], number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, nargs="+", default=[4, 6, 8])
    parser.add_argument("--sizes", type=int, nargs="*", default=[64, 1000, 4096, 65536])
    parser.add_argument("--no-timing", action="store_true")
    args = parser.parse_args(argv)
    saved = sampling.FEISTEL_ROUNDS
    print(
        "| family    |      n | epochs | p0,p1 adjacent   | adjacent pairs   "
        "| serial corr (z)   | max chi z |"
    )
    print("|---|---|---|---|---|---|---|")
    try:
        for n in args.sizes:
            e = TABLE_EPOCHS.get(n, 1_000)
            print(_row("randperm", n, e, randperm_stats(n, e)), flush=True)
            for r in args.rounds:
                sampling.FEISTEL_ROUNDS = r
                print(_row(f"{r} rounds", n, e, sampler_stats(n, e)), flush=True)
    finally:
        sampling.FEISTEL_ROUNDS = saved
    if args.no_timing:
        return
    print("\nper-epoch table build (n <= 2**16), us, best of 5:")
    one = np.zeros(1, dtype=np.int64)
    for n in (64, 4096, 65536):
        cells = []
        for r in args.rounds:
            us = _best_us(lambda n=n, r=r: FeistelPermutation(n, 7, rounds=r)(one), 20)
            cells.append(f"{r} rounds {us:7.0f}")
        print(f"  n={n:6}: " + "   ".join(cells))
    # The cycle walk's length depends on the key, so average over 4 keys.
    print("per-batch path (n > 2**16), us per call (mean of 4 keys, best of 5):")
    for n in (10**6, 10**8, 10**12):
        for size in (1024, 65536):
            pos = np.arange(1000, 1000 + size, dtype=np.int64)
            cells = []
            for r in args.rounds:
                perms = [FeistelPermutation(n, key, rounds=r) for key in range(4)]
                us = _best_us(lambda p=perms, x=pos: [perm(x) for perm in p], 3) / len(perms)
                cells.append(f"{r} rounds {us:7.0f}")
            print(f"  n={n:.0e} batch={size:5}: " + "   ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1:])
