#!/usr/bin/env python
"""Benchmark: trainer.compile=true against false on the GPT text job (tokens/s).

    python scripts/bench/bench_compile.py [--repeats 3] [--nproc 2] [--steps 80] [extra ...]

Each repeat runs the two jobs back to back (`python -m hydra_ddp.train data=text model=gpt
dist.nproc_per_node=N logger=none ...`, compile off then on) and reads rank 0's per-window
`tokens_per_s` from `stats/rank0.jsonl`, leaving out the windows up to `--skip` steps (the
compile itself happens in the first steps). It prints, per repeat, both steady-state rates,
their ratio (compiled / eager) and the compiled job's extra time to its first logged window,
then the medians. Only public entry points: the command a user types and the files it writes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_job(workdir: Path, name: str, compile_: bool, args: argparse.Namespace) -> dict:
    out = workdir / name
    cmd = [
        sys.executable,
        "-m",
        "hydra_ddp.train",
        "data=text",
        "model=gpt",
        f"dist.nproc_per_node={args.nproc}",
        "logger=none",
        "trainer.progress=false",
        f"trainer.max_steps={args.steps}",
        f"trainer.log_interval={args.log_interval}",
        f"trainer.compile={str(compile_).lower()}",
        f"hydra.run.dir={out}",
        *args.extra,
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"job failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(ln) for ln in (out / "stats" / "rank0.jsonl").read_text().splitlines()]
    steady = [r["tokens_per_s"] for r in rows if r["step"] > args.skip]
    first = rows[0]["step_time"] * rows[0]["step"] if rows else float("nan")
    return {"tokens_per_s": statistics.median(steady), "first_window_s": first, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--skip", type=int, default=20, help="steps left out of steady state")
    parser.add_argument("--out", type=Path, help="write the measurements here as JSON")
    parser.add_argument("extra", nargs="*", help="extra overrides for both jobs")
    args = parser.parse_args()

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            eager = run_job(Path(tmp), f"eager{i}", False, args)
            compiled = run_job(Path(tmp), f"compiled{i}", True, args)
            ratio = compiled["tokens_per_s"] / eager["tokens_per_s"]
            results.append({"eager": eager, "compiled": compiled, "ratio": ratio})
            print(
                f"repeat {i}: eager {eager['tokens_per_s']:.0f} tokens/s, compiled "
                f"{compiled['tokens_per_s']:.0f} tokens/s, ratio {ratio:.3f}; first window "
                f"{eager['first_window_s']:.1f} s vs {compiled['first_window_s']:.1f} s",
                flush=True,
            )
    print(
        f"median ratio compiled/eager: {statistics.median(r['ratio'] for r in results):.3f} "
        f"(eager {statistics.median(r['eager']['tokens_per_s'] for r in results):.0f}, "
        f"compiled {statistics.median(r['compiled']['tokens_per_s'] for r in results):.0f} "
        "tokens/s at rank 0)"
    )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
