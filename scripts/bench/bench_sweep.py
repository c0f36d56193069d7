"""Wall time of one sweep of N jobs: Hydra's basic launcher (one job after another) against
hydra/launcher=ray (as many at once as the machine's CPUs hold), the same jobs, the commands a
user types. Variants alternate, so a change in the machine's load hits both.

    python scripts/bench/bench_sweep.py                        # 8 jobs x 1 rank, 2 repeats
    python scripts/bench/bench_sweep.py --jobs 8 --steps 400 --repeats 3 --out sweep.json

Each variant runs in a scratch dir under /tmp with W&B off; the Ray variant starts and stops
its own Ray inside the timed command (its start-up is part of what a user waits for). Results
go in docs/benchmarks.md with the exact command and the machine's load.
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


def sweep_command(launcher: str, jobs: int, steps: int, nproc: int) -> list[str]:
    rates = ",".join(f"{0.001 * (i + 1):g}" for i in range(jobs))
    cmd = [sys.executable, "-m", "hydra_ddp.train", "-m", f"optim.lr={rates}"]
    cmd += ["logger=none", "trainer.progress=false", f"trainer.max_steps={steps}"]
    cmd += [f"dist.nproc_per_node={nproc}"]
    if launcher == "ray":
        cmd += ["hydra/launcher=ray"]
    return cmd


def run_once(launcher: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench_sweep_{launcher}_") as tmp:
        cmd = sweep_command(launcher, args.jobs, args.steps, args.nproc)
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
        env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun and the basic sweep's ranks get
        load = os.getloadavg()[0]
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
        wall = time.monotonic() - start
        if proc.returncode != 0:
            sys.exit(f"{launcher} sweep failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        report = json.loads(next(Path(tmp).rglob("sweep_report.json")).read_text())
        ok = sum(j["status"] == "ok" for j in report)
        return {"launcher": launcher, "wall_s": wall, "ok": ok, "load_before": load}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=400, help="trainer.max_steps of each job")
    parser.add_argument("--nproc", type=int, default=1, help="dist.nproc_per_node of each job")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    print(f"{args.jobs} jobs x {args.nproc} rank(s), {args.steps} steps; {os.cpu_count()} CPUs")
    runs = []
    for repeat in range(args.repeats):
        order = ("basic", "ray") if repeat % 2 == 0 else ("ray", "basic")
        for launcher in order:
            result = run_once(launcher, args)
            runs.append(result)
            print(
                f"repeat {repeat}: {launcher:5s} {result['wall_s']:7.1f} s, "
                f"{result['ok']}/{args.jobs} ok, load {result['load_before']:.1f} before"
            )
    walls = {k: [r["wall_s"] for r in runs if r["launcher"] == k] for k in ("basic", "ray")}
    ratios = [b / r for b, r in zip(walls["basic"], walls["ray"])]
    print(
        f"median wall: basic {statistics.median(walls['basic']):.1f} s, "
        f"ray {statistics.median(walls['ray']):.1f} s; basic/ray per repeat "
        f"{', '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f})"
    )
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": runs}))


if __name__ == "__main__":
    main()
