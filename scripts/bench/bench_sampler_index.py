#!/usr/bin/env python
"""Benchmark: memory and latency of producing one rank's sample indices.

Compares hydra_ddp.data.sampling.StridedSampler (indices computed per batch from a
keyed Feistel permutation) with torch.utils.data.DistributedSampler (which
materialises ``torch.randperm(N).tolist()`` every epoch) for one rank of a
shuffled epoch.

Each sampler runs in a fresh child process (``--worker ours|torch``) so that its
peak memory can be measured in isolation as

    peak = child's peak RSS (getrusage ru_maxrss) - child's RSS right after imports

Both children import the same modules (numpy, torch, hydra_ddp.data.sampling), so the
baseline is comparable.  Timings start just before the sampler is constructed:

* time to first index:   construct + ``iter`` + first index (ours: first batch)
* time to --count:       until at least --count indices have been produced
                         (ours: batches of --batch-size; torch: its iterator)

Usage:
    python scripts/bench/bench_sampler_index.py [--n 100000000] [--world-size 8]
        [--rank 3] [--count 1000000] [--batch-size 1024] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
_SRC = _REPO / "src"


def _ensure_importable() -> None:
    """Make hydra_ddp importable from a source checkout that is not pip-installed."""
    try:
        import hydra_ddp.data.sampling  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(_SRC))


def _rss_bytes() -> int:
    """Current resident set size of this process."""
    import psutil

    return psutil.Process().memory_info().rss


def _maxrss_bytes() -> int:
    """Peak resident set size of this process so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def run_worker(args: argparse.Namespace) -> dict:
    """Measure one sampler in this (fresh) process and return the numbers."""
    _ensure_importable()
    import itertools

    import numpy as np  # noqa: F401  (same imports in both workers -> comparable baseline)
    import torch  # noqa: F401
    from torch.utils.data import DistributedSampler

    from hydra_ddp.data.sampling import StridedSampler

    gc.collect()
    rss_after_imports = _rss_bytes()
    maxrss_after_imports = _maxrss_bytes()

    produced = 0
    t0 = time.perf_counter()
    if args.worker == "ours":
        sampler = StridedSampler(
            args.n, args.rank, args.world_size, args.batch_size, shuffle=True, seed=args.seed
        )
        it = iter(sampler)
        batch = next(it)
        first_index = int(batch[0])
        t_first = time.perf_counter() - t0
        produced = len(batch)
        while produced < args.count:
            produced += len(next(it))
        t_count = time.perf_counter() - t0
    else:
        sampler = DistributedSampler(
            range(args.n),
            num_replicas=args.world_size,
            rank=args.rank,
            shuffle=True,
            seed=args.seed,
        )
        it = iter(sampler)
        first_index = int(next(it))
        t_first = time.perf_counter() - t0
        produced = 1
        for _ in itertools.islice(it, args.count - 1):
            produced += 1
        t_count = time.perf_counter() - t0

    rss_end = _rss_bytes()
    maxrss_end = _maxrss_bytes()
    return {
        "worker": args.worker,
        "first_index": first_index,
        "produced": produced,
        "t_first_s": t_first,
        "t_count_s": t_count,
        "rss_after_imports": rss_after_imports,
        "maxrss_after_imports": maxrss_after_imports,
        "rss_end": rss_end,
        "maxrss_end": maxrss_end,
        "peak_bytes": maxrss_end - rss_after_imports,
    }


def _spawn(worker: str, args: argparse.Namespace) -> dict:
    """Run one worker in a fresh interpreter and parse its JSON result."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        worker,
        "--n",
        str(args.n),
        "--world-size",
        str(args.world_size),
        "--rank",
        str(args.rank),
        "--count",
        str(args.count),
        "--batch-size",
        str(args.batch_size),
        "--seed",
        str(args.seed),
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_SRC), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"worker {worker} failed (rc={proc.returncode}):\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _mib(x: float) -> str:
    return f"{x / 2**20:,.1f}"


def _ms(x: float) -> str:
    return f"{x * 1e3:,.2f}"


def _report(args: argparse.Namespace, ours: dict, theirs: dict) -> str:
    """Markdown table plus ratios and target verdicts."""
    mem_ratio = ours["peak_bytes"] / theirs["peak_bytes"]
    first_ratio = ours["t_first_s"] / theirs["t_first_s"]
    count_ratio = ours["t_count_s"] / theirs["t_count_s"]
    rows = [
        "| sampler | peak memory (MiB) | time to first index (ms) "
        f"| time to {args.count:,} indices (ms) | RSS after imports (MiB) | peak RSS (MiB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in (("StridedSampler (ours)", ours), ("DistributedSampler (torch)", theirs)):
        rows.append(
            f"| {name} | {_mib(r['peak_bytes'])} | {_ms(r['t_first_s'])} | {_ms(r['t_count_s'])} "
            f"| {_mib(r['rss_after_imports'])} | {_mib(r['maxrss_end'])} |"
        )
    mem_ok = mem_ratio <= 1 / 20
    first_ok = first_ratio <= 1 / 10
    lines = [
        f"### N={args.n:,}, world_size={args.world_size}, rank={args.rank}, shuffle=True, "
        f"batch_size={args.batch_size}, count={args.count:,}",
        "",
        f"{datetime.datetime.now().isoformat(timespec='seconds')} · "
        f"Python {platform.python_version()} · "
        f"{os.cpu_count()} CPUs · {platform.machine()}",
        "",
        *rows,
        "",
        f"- memory ours/torch: {mem_ratio:.2e} "
        f"(target <= 1/20 = 5.00e-02: {'met' if mem_ok else 'NOT met'})",
        f"- time to first index ours/torch: {first_ratio:.2e} "
        f"(target <= 1/10 = 1.00e-01: {'met' if first_ok else 'NOT met'})",
        f"- time to {args.count:,} indices ours/torch: {count_ratio:.2e}",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Parse flags; run as parent (spawn both workers, report) or as a worker."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=10**8, help="dataset rows")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--rank", type=int, default=3)
    parser.add_argument("--count", type=int, default=10**6, help="indices to produce")
    parser.add_argument(
        "--batch-size", type=int, default=1024, help="batch size for StridedSampler"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=None, help="markdown file to append the results to"
    )
    parser.add_argument("--worker", choices=("ours", "torch"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker is not None:
        print(json.dumps(run_worker(args)))
        return

    print(f"running ours (N={args.n:,}) ...", file=sys.stderr)
    ours = _spawn("ours", args)
    print("running torch DistributedSampler ...", file=sys.stderr)
    theirs = _spawn("torch", args)
    report = _report(args, ours, theirs)
    print(report)
    print("raw:", json.dumps({"ours": ours, "torch": theirs}))
    if args.out is not None:
        with args.out.open("a", encoding="utf-8") as fh:
            fh.write(report + "\n")


if __name__ == "__main__":
    main()
