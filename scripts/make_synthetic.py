"""Write a synthetic classification data set to disk for `data=synthetic`.

    python scripts/make_synthetic.py --out data/synthetic --rows 100000 --features 64 --shards 4
    python scripts/make_synthetic.py --out data/big --size-gib 1.5 --features 256 --shards 8

Layout: one pair of .npy files per shard and split (`train_00000.x.npy`, `train_00000.y.npy`,
...) plus `manifest.json` listing every file with its row count. Each class is a Gaussian blob
around its own random centre, so the set is learnable and accuracy says something. Rows are
written in chunks through memory-mapped .npy files, so gigabytes need only megabytes of RAM.
Uneven shard sizes (--uneven) exercise the sharded sampler's equal-steps rule.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

CHUNK_ROWS = 65536


def shard_sizes(rows: int, shards: int, uneven: bool, rng: np.random.Generator) -> list[int]:
    if not uneven:
        return [rows // shards + (1 if i < rows % shards else 0) for i in range(shards)]
    weights = rng.uniform(0.5, 1.5, size=shards)
    sizes = np.floor(weights / weights.sum() * rows).astype(int)
    sizes[0] += rows - sizes.sum()
    return [int(s) for s in sizes]


def write_split(
    out: Path,
    split: str,
    sizes: list[int],
    centres: np.ndarray,
    noise: float,
    rng: np.random.Generator,
) -> list[dict]:
    classes, features = centres.shape
    files = []
    for i, n in enumerate(sizes):
        xname, yname = f"{split}_{i:05d}.x.npy", f"{split}_{i:05d}.y.npy"
        x = np.lib.format.open_memmap(out / xname, mode="w+", dtype=np.float32, shape=(n, features))
        y = np.lib.format.open_memmap(out / yname, mode="w+", dtype=np.int16, shape=(n,))
        for lo in range(0, n, CHUNK_ROWS):
            hi = min(lo + CHUNK_ROWS, n)
            labels = rng.integers(0, classes, size=hi - lo)
            x[lo:hi] = centres[labels] + noise * rng.standard_normal(
                (hi - lo, features), dtype=np.float32
            )
            y[lo:hi] = labels
        x.flush()
        y.flush()
        del x, y
        files.append({"x": xname, "y": yname, "rows": n})
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory to write (must not hold a data set)")
    p.add_argument("--rows", type=int, default=100_000, help="training rows")
    p.add_argument(
        "--size-gib",
        type=float,
        default=None,
        help="instead of --rows: training rows for about this many GiB of features",
    )
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--shards", type=int, default=4, help="training files")
    p.add_argument("--uneven", action="store_true", help="shards of different sizes")
    p.add_argument(
        "--eval-rows",
        type=int,
        default=None,
        help="rows in each of val and test (default: 10%% of --rows, at most 50k)",
    )
    p.add_argument("--noise", type=float, default=3.0, help="std of the blobs; higher = harder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="overwrite an existing data set")
    args = p.parse_args(argv)

    rows = args.rows
    if args.size_gib is not None:
        rows = int(args.size_gib * 2**30 / (4 * args.features))
    for name, value in [
        ("--rows", rows),
        ("--features", args.features),
        ("--classes", args.classes),
        ("--shards", args.shards),
    ]:
        if value < 1:
            print(f"error: {name} must be >= 1 (got {value})", file=sys.stderr)
            return 2
    if args.shards > rows:
        print(f"error: --shards={args.shards} is more than --rows={rows}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if (out / "manifest.json").exists() and not args.force:
        print(
            f"error: {out} already holds a data set; pass --force to overwrite it, or choose "
            "another --out",
            file=sys.stderr,
        )
        return 2
    out.mkdir(parents=True, exist_ok=True)

    rng = np.random.default_rng(args.seed)
    centres = rng.standard_normal((args.classes, args.features)).astype(np.float32)
    eval_rows = args.eval_rows if args.eval_rows is not None else max(1, min(rows // 10, 50_000))
    splits = {
        "train": write_split(
            out, "train", shard_sizes(rows, args.shards, args.uneven, rng), centres, args.noise, rng
        ),
        "val": write_split(out, "val", [eval_rows], centres, args.noise, rng),
        "test": write_split(out, "test", [eval_rows], centres, args.noise, rng),
    }
    manifest = {
        "features": args.features,
        "classes": args.classes,
        "seed": args.seed,
        "noise": args.noise,
        "splits": splits,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    total = sum(f["rows"] for f in splits["train"])
    print(
        f"wrote {total} training rows in {args.shards} shard(s) "
        f"({total * args.features * 4 / 2**30:.2f} GiB of features) to {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
