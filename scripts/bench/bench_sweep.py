"""Wall time of the same N one-rank jobs run three ways, the commands a user types:

* basic: `python -m hydra_ddp.train -m optim.lr=...` (Hydra's basic launcher: one job after
  another, in the sweep's process);
* ray: the same with `hydra/launcher=ray` (a Ray started by the sweep, as many jobs at once as
  the machine's CPUs hold, each a fresh interpreter);
* by hand: one `python -m hydra_ddp.train optim.lr=X` per job, at most `--parallel` at a time
  (as `xargs -P 2` would start them): what the machine allows, with nothing in between.

    python scripts/bench/bench_sweep.py                              # 4 jobs x 12000 steps
    python scripts/bench/bench_sweep.py --steps 12000 3000 800 --repeats 2 --out sweep.json

For each job length the three variants run in turn, the order rotating each repeat, so a
change in the machine's load hits all three. Each run waits first for the CPUs to be quiet
(below 20 % over a second, at most `--quiet-wait` s) and records the load average before and
after, and how many cores other processes used while it ran (the machine's busy CPU time less
the run's own, sampled). Every
job has W&B off, `trainer.progress=false` and OMP_NUM_THREADS=1 (what torchrun and the Ray
launcher give a one-CPU rank). Printed: each run's wall time and its jobs' mean samples/s
(summary.json), for the two sweeps when the first job's process started and how long the
sweep took to exit after its last job ended (from its journal), then per job length the ratios
ray/by hand, basic/by hand and ray/basic. Results go in docs/benchmarks.md with the exact
command, the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

VARIANTS = ("basic", "ray", "by_hand")
# Each sweep and each job by hand in a session of its own, as a command typed in a terminal
# of its own, and as each Ray job runs: Linux's scheduler shares the CPUs between sessions
# first (autogroups), so on a machine that others use too, jobs started in this script's one
# session would get one share between them where Ray's get one each.
_SESSION = {"start_new_session": True}


def job_overrides(steps: int) -> list[str]:
    return ["logger=none", "trainer.progress=false", f"trainer.max_steps={steps}"]


def rates(jobs: int) -> list[str]:
    return [f"{0.001 * (i + 1):g}" for i in range(jobs)]


def sweep_command(launcher: str, jobs: int, steps: int) -> list[str]:
    cmd = [sys.executable, "-m", "hydra_ddp.train", "-m", f"optim.lr={','.join(rates(jobs))}"]
    cmd += job_overrides(steps)
    return cmd + (["hydra/launcher=ray"] if launcher == "ray" else [])


def by_hand(jobs: int, steps: int, parallel: int, cwd: Path, env: dict[str, str]) -> None:
    """Each job its own `python -m hydra_ddp.train`, `parallel` at a time."""

    def one(lr: str) -> int:
        cmd = [sys.executable, "-m", "hydra_ddp.train", f"optim.lr={lr}", *job_overrides(steps)]
        cmd += [f"hydra.run.dir=by_hand/lr{lr}"]
        # In a session of its own, as each Ray job is (`_SESSION`).
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, **_SESSION).returncode

    with ThreadPoolExecutor(parallel) as pool:
        codes = list(pool.map(one, rates(jobs)))
    if any(codes):
        sys.exit(f"by-hand jobs failed: exit codes {codes}")


def wait_quiet(busy_percent: float = 20.0, limit_s: float = 60.0) -> float:
    """Wait until the CPUs' use over one second is below `busy_percent` (or `limit_s` passed);
    returns the last reading."""
    deadline = time.monotonic() + limit_s
    while (used := psutil.cpu_percent(interval=1.0)) > busy_percent:
        if time.monotonic() > deadline:
            break
    return used


def run_once(variant: str, args: argparse.Namespace, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench_sweep_{variant}_") as tmp:
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", WANDB_MODE="disabled")
        env["OMP_NUM_THREADS"] = "1"
        cpu = wait_quiet(limit_s=args.quiet_wait)
        load = os.getloadavg()[0]
        busy, ours = _busy_cpu_s(), _OwnCpu()
        start, started_at = time.monotonic(), time.time()
        if variant == "by_hand":
            by_hand(args.jobs, steps, args.parallel, Path(tmp), env)
        else:
            cmd = sweep_command(variant, args.jobs, steps)
            proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, **_SESSION)
            if proc.returncode != 0:
                sys.exit(f"{variant} sweep failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        wall = time.monotonic() - start
        ended_at = time.time()
        # What other processes on the machine used meanwhile, in cores: all the CPUs' busy
        # time less this run's (its processes are all reaped children of this one).
        others = (_busy_cpu_s() - busy - ours.stop()) / wall
        found = [p for p in Path(tmp).rglob("summary.json") if p.parent.name != "stats"]
        summaries = [json.loads(p.read_text()) for p in found]
        if len(summaries) != args.jobs:
            sys.exit(f"{variant}: {len(summaries)} of {args.jobs} jobs wrote a summary")
        lead, tail = _lead_and_tail(Path(tmp), started_at, ended_at)
        return {
            "variant": variant,
            "steps": steps,
            "wall_s": wall,
            "lead_s": lead,
            "tail_s": tail,
            "samples_per_s": statistics.mean(s["samples_per_s"] for s in summaries),
            "load_before": load,
            "load_after": os.getloadavg()[0],
            "others_cores": others,
            "cpu_percent_before": cpu,
        }


def _busy_cpu_s() -> float:
    """Seconds the machine's CPUs were busy since boot (all processes; not the time a
    hypervisor gave other machines)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


class _OwnCpu:
    """The CPU seconds this script's processes (a run's: a sweep, Ray's, the jobs', all
    descendants) use from now to `stop`, sampled twice a second: Ray reaps some of its own
    without the kernel adding their time to any parent's."""

    def __init__(self) -> None:
        self.seen: dict[int, float] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._sample_once()  # what this script used already is not the run's
        self._before = sum(self.seen.values())
        self._thread.start()

    def _sample_once(self) -> None:
        me = psutil.Process()
        for p in [me, *me.children(recursive=True)]:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            self.seen[p.pid] = max(self.seen.get(p.pid, 0.0), t.user + t.system)

    def _sample(self) -> None:
        while not self._done.wait(0.5):
            self._sample_once()

    def stop(self) -> float:
        self._done.set()
        self._thread.join()
        self._sample_once()
        return sum(self.seen.values()) - self._before


def _lead_and_tail(root: Path, started_at: float, ended_at: float) -> tuple[float, float]:
    """A sweep's seconds from its command's start to its first job's process start (or the
    job's start in the sweep's process), and from its last job's end to the command's exit,
    from its journal; NaN for the jobs by hand (no journal)."""
    journals = list(root.rglob("sweep_jobs.jsonl"))
    if not journals:
        return float("nan"), float("nan")
    records = [json.loads(line) for line in journals[0].read_text().splitlines()]
    starts = [r.get("process_start", r["time"]) for r in records if r["event"] == "start"]
    ends = [r["time"] for r in records if r["event"] == "end"]
    return min(starts) - started_at, ended_at - max(ends)


_RATIOS = [("ray", "by_hand"), ("basic", "by_hand"), ("ray", "basic")]


def _ratio(runs: list[dict], steps: int, a: str, b: str) -> str:
    """The wall time of `a` over `b`'s in each repeat: their median, then each."""
    walls = {
        v: [r["wall_s"] for r in runs if r["variant"] == v and r["steps"] == steps] for v in (a, b)
    }
    per = [x / y for x, y in zip(walls[a], walls[b])]
    return f"{statistics.median(per):.2f} ({', '.join(f'{x:.2f}' for x in per)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument(
        "--steps", type=int, nargs="+", default=[12000], help="trainer.max_steps of each job"
    )
    parser.add_argument("--parallel", type=int, default=2, help="by hand: jobs at a time")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--quiet-wait", type=float, default=60.0, help="seconds to wait for idle CPUs at most"
    )
    args = parser.parse_args()
    print(f"{args.jobs} one-rank jobs; {os.cpu_count()} CPUs; by hand {args.parallel} at a time")
    runs = []
    for repeat in range(args.repeats):
        for steps in args.steps:
            shift = repeat % len(VARIANTS)  # each variant first in turn
            for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                r = run_once(variant, args, steps)
                runs.append(r | {"repeat": repeat})
                print(
                    f"repeat {repeat}, {steps} steps: {variant:8s} {r['wall_s']:6.1f} s, "
                    f"{r['samples_per_s']:7.0f} samples/s per job, first job's start at "
                    f"{r['lead_s']:.1f} s, exit {r['tail_s']:.1f} s after the last job's end, "
                    f"load {r['load_before']:.1f} before, {r['load_after']:.1f} after, other "
                    f"processes {r['others_cores']:.2f} cores meanwhile",
                    flush=True,
                )
    for steps in args.steps:
        ratios = [f"{a}/{b} {_ratio(runs, steps, a, b)}" for a, b in _RATIOS]
        print(f"{steps} steps: {'; '.join(ratios)}")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": runs}))


if __name__ == "__main__":
    main()
