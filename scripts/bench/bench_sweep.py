"""Wall time of one sweep of N jobs: Hydra's basic launcher (one job after another) against
hydra/launcher=ray (as many at once as the machine's CPUs hold), the same jobs, the commands a
user types. Variants alternate, so a change in the machine's load hits both.

    python scripts/bench/bench_sweep.py                        # 8 jobs x 1 rank, 2 repeats
    python scripts/bench/bench_sweep.py --jobs 8 --steps 400 --repeats 3 --out sweep.json
    python scripts/bench/bench_sweep.py --cold                 # + Ray without warm starts
    python scripts/bench/bench_sweep.py --joined               # + Ray already running

Each variant runs in a scratch dir under /tmp with W&B off and OMP_NUM_THREADS=1; the Ray
variant starts and stops its own Ray inside the timed command (its start-up is part of what a
user waits for). Each run waits first for the CPUs to be quiet (below 20 % over a second, at
most 60 s): a Ray that the run before is still shutting down would otherwise slow the next.
Besides the wall time it reports each job's start-up: from when its process
started (Ray: the task's fork or Popen; basic: the job's start in the sweep's process) to the
end of its first step (`trainer.log_interval=1`, the same for every variant). Results go in
docs/benchmarks.md with the exact command and the machine's load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import psutil


def sweep_command(
    launcher: str, jobs: int, steps: int, nproc: int, address: str | None = None
) -> list[str]:
    rates = ",".join(f"{0.001 * (i + 1):g}" for i in range(jobs))
    cmd = [sys.executable, "-m", "hydra_ddp.train", "-m", f"optim.lr={rates}"]
    cmd += ["logger=none", "trainer.progress=false", f"trainer.max_steps={steps}"]
    cmd += [f"dist.nproc_per_node={nproc}", "trainer.log_interval=1"]
    if launcher.startswith("ray"):
        cmd += ["hydra/launcher=ray"]
    if launcher == "ray-cold":
        cmd += ["hydra.launcher.warm_start=false"]
    if launcher == "ray-joined":  # a Ray already running on this machine: its start not timed
        cmd += [f"hydra.launcher.address={address}"]
    return cmd


@contextlib.contextmanager
def ray_head(tmp: Path) -> Iterator[str]:
    """`ray start --head` on this machine (its CPUs, no dashboard), stopped at the end."""
    port = 6390
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_worker_niceness="0")
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}",
           f"--num-cpus={os.cpu_count()}", "--num-gpus=0", "--include-dashboard=false",
           "--disable-usage-stats"]  # fmt: skip
    subprocess.run(cmd, cwd=tmp, env=env, check=True, capture_output=True)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop = [sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"]
        subprocess.run(stop, cwd=tmp, env=env, capture_output=True)


def startups(sweep_dir: Path) -> list[float]:
    """Each job's seconds from its process start (or its start in the sweep's process) to the
    end of its first step."""
    starts = {}
    for line in (sweep_dir / "sweep_jobs.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["event"] == "start":
            starts[record["dir"]] = record.get("process_start", record["time"])
    out = []
    for job_dir, start in starts.items():
        with open(Path(job_dir) / "stats" / "rank0.jsonl") as f:
            first = json.loads(f.readline())
        out.append(first["time"] - start)
    return out


def wait_quiet(busy_percent: float = 20.0, limit_s: float = 60.0) -> float:
    """Wait until the CPUs' use over one second is below `busy_percent` (or `limit_s` passed);
    returns the last reading."""
    deadline = time.monotonic() + limit_s
    while (used := psutil.cpu_percent(interval=1.0)) > busy_percent:
        if time.monotonic() > deadline:
            break
    return used


def run_once(launcher: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench_sweep_{launcher}_") as tmp:
        cmd = sweep_command(launcher, args.jobs, args.steps, args.nproc, args.address)
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
        if launcher == "ray-joined":
            env["RAY_AUTH_MODE"] = "disabled"
        env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun and the basic sweep's ranks get
        cpu = wait_quiet()
        load = os.getloadavg()[0]
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
        wall = time.monotonic() - start
        if proc.returncode != 0:
            sys.exit(f"{launcher} sweep failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        report_path = next(Path(tmp).rglob("sweep_report.json"))
        report = json.loads(report_path.read_text())
        ok = sum(j["status"] == "ok" for j in report)
        ups = startups(report_path.parent)
        return {
            "launcher": launcher,
            "wall_s": wall,
            "ok": ok,
            "load_before": load,
            "cpu_percent_before": cpu,
            "startup_s": statistics.median(ups),
            "startups_s": ups,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=400, help="trainer.max_steps of each job")
    parser.add_argument("--nproc", type=int, default=1, help="dist.nproc_per_node of each job")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--cold", action="store_true", help="also Ray with warm_start=false")
    parser.add_argument(
        "--joined", action="store_true", help="also Ray joined: a `ray start --head` made first"
    )
    args = parser.parse_args()
    variants = ["basic", "ray"] + (["ray-cold"] if args.cold else [])
    variants += ["ray-joined"] if args.joined else []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        args.address = stack.enter_context(ray_head(Path(tmp))) if args.joined else None
        _repeats(args, variants)


def _repeats(args: argparse.Namespace, variants: list[str]) -> None:
    print(f"{args.jobs} jobs x {args.nproc} rank(s), {args.steps} steps; {os.cpu_count()} CPUs")
    runs = []
    for repeat in range(args.repeats):
        shift = repeat % len(variants)  # each variant first in turn
        for launcher in variants[shift:] + variants[:shift]:
            result = run_once(launcher, args)
            runs.append(result)
            print(
                f"repeat {repeat}: {launcher:8s} {result['wall_s']:7.1f} s, "
                f"{result['ok']}/{args.jobs} ok, job start-up {result['startup_s']:.2f} s "
                f"(median), load {result['load_before']:.1f}, "
                f"CPUs {result['cpu_percent_before']:.0f} % before"
            )
    by = {k: [r for r in runs if r["launcher"] == k] for k in variants}
    for name in variants[1:]:
        ratios = [r["wall_s"] / b["wall_s"] for b, r in zip(by["basic"], by[name])]
        extra = [r["startup_s"] - b["startup_s"] for b, r in zip(by["basic"], by[name])]
        print(
            f"{name}/basic wall per repeat {', '.join(f'{x:.2f}' for x in ratios)} "
            f"(median {statistics.median(ratios):.2f}); job start-up over basic's per repeat "
            f"{', '.join(f'{x:+.2f}' for x in extra)} s (median {statistics.median(extra):+.2f} s)"
        )
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": runs}))


if __name__ == "__main__":
    main()
