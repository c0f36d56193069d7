"""Benchmark: hydra_ddp's training loop against a hand-written minimal DDP loop.

    python scripts/bench_speed.py                      # 5 interleaved repeats, 2 ranks, 40 epochs
    python scripts/bench_speed.py --repeats 7 --no-wandb --out /tmp/speed.json

Every job is started the way a user starts it, with torchrun, from a scratch directory under
/tmp (so Hydra's outputs land there):

  minimal        torchrun --standalone --nproc_per_node=N scripts/minimal_ddp.py --epochs E
  ours           torchrun --standalone --nproc_per_node=N -m hydra_ddp.train logger=none
                     trainer.progress=false trainer.epochs=E        (default job: model=mlp,
                     data=digits, batch 64 per rank, log_interval 10)
  ours-startup   the same with trainer.log_interval=1 trainer.max_steps=S (first step time)
  wandb          ours with logger=wandb (the default), W&B forced offline, its dirs isolated
  wandb-startup  likewise with trainer.log_interval=1 trainer.max_steps=S

One repeat runs each variant once; the order rotates from repeat to repeat, so slow phases of a
shared machine hit every variant alike. Ratios are taken within a repeat and their median is
reported (plus the ratio of the medians).

What is measured (same definition for both loops, all wall-clock on rank 0):

* steady-state samples/s: global samples trained in steps skip+1 .. last (skip=20), divided by
  the time between the end of step `skip` and the end of the last step. Minimal: time.time()
  right after opt.step(). Ours: the `time` field of stats/rank0.jsonl at those steps, which
  is stamped right after that step's stats were logged, so ours pays its logging inside the
  window. Samples: minimal counts them; ours reads samples_seen (per rank) x world size.
* loop samples/s: all samples / (loop end - loop start), startup excluded, first steps
  included. Ours: summary.json samples_per_s; minimal: the same from its own stamps.
* time to first step: from time.time() just before the torchrun subprocess is started to the
  moment rank 0 finished its first optimizer step. Minimal: its printed stamp. Ours: the
  first line of stats/rank0.jsonl in the ours-startup job (log_interval=1, so the line is
  written right after step 1 and its stats all_gather).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MINIMAL = REPO / "scripts" / "minimal_ddp.py"
VARIANTS = ("minimal", "ours", "ours-startup", "wandb", "wandb-startup")


def user_env(scratch: Path, wandb: bool) -> dict[str, str]:
    """A user's environment with no W&B login: offline, nothing read from $HOME."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("WANDB_", "TORCHELASTIC_", "SLURM_", "SUBMITIT_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(NETRC=str(scratch / "no-netrc"), WANDB_CONFIG_DIR=str(scratch / "wandb-config"),
               WANDB_CACHE_DIR=str(scratch / "wandb-cache"),
               WANDB_DATA_DIR=str(scratch / "wandb-data"), PYTHONUNBUFFERED="1")
    if wandb:
        env["WANDB_MODE"] = "offline"
    return env


def command(variant: str, args: argparse.Namespace, run_dir: Path) -> list[str]:
    torchrun = [shutil.which("torchrun") or "torchrun", "--standalone",
                f"--nproc_per_node={args.nproc}"]
    if variant == "minimal":
        return torchrun + [str(MINIMAL), "--epochs", str(args.epochs), "--skip", str(args.skip)]
    cmd = torchrun + ["-m", "hydra_ddp.train", "trainer.progress=false",
                      f"hydra.run.dir={run_dir}"]
    cmd.append("logger=none" if variant.startswith("ours") else "logger=wandb")
    if variant.endswith("startup"):
        cmd += ["trainer.log_interval=1", f"trainer.max_steps={args.startup_steps}"]
    else:
        cmd += [f"trainer.epochs={args.epochs}"]
    return cmd + args.extra


def run_one(variant: str, args: argparse.Namespace, scratch: Path, rep: int) -> dict:
    run_dir = scratch / "runs" / f"{variant}-{rep}"
    cmd = command(variant, args, run_dir)
    env = user_env(scratch, wandb=variant.startswith("wandb"))
    t_launch = time.time()
    proc = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True,
                          timeout=args.timeout)
    t_exit = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed (rc {proc.returncode}): {' '.join(cmd)}\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    out = {"variant": variant, "repeat": rep, "command_s": t_exit - t_launch}
    if variant == "minimal":
        line = next(l for l in proc.stdout.splitlines() if l.startswith("MINIMAL_DDP "))
        m = json.loads(line.split(" ", 1)[1])
        world = m["world_size"]
        out["first_step_s"] = m["first_step"] - t_launch
        out["steady_sps"] = ((m["samples_per_rank"] - m["skip_samples"]) * world
                             / (m["loop_end"] - m["skip_step"]))
        out["loop_sps"] = m["samples_per_rank"] * world / (m["loop_end"] - m["loop_start"])
        out["steps"] = m["steps"]
        return out
    lines = [json.loads(l) for l in (run_dir / "stats" / "rank0.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    world = summary["world_size"]
    out["steps"] = lines[-1]["step"]
    if variant.endswith("startup"):
        assert lines[0]["step"] == 1, lines[0]
        out["first_step_s"] = lines[0]["time"] - t_launch
    else:
        at = {l["step"]: l for l in lines}
        if args.skip not in at:
            raise SystemExit(f"no stats line at step {args.skip}: --skip must be a multiple of "
                             "trainer.log_interval")
        a, b = at[args.skip], lines[-1]
        out["steady_sps"] = (b["samples_seen"] - a["samples_seen"]) * world / (b["time"] - a["time"])
        out["loop_sps"] = summary["samples_per_s"]
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


def median(rows: list[dict], variant: str, key: str) -> float:
    vals = [r[key] for r in rows if r["variant"] == variant and key in r]
    return statistics.median(vals) if vals else float("nan")


def paired(rows: list[dict], num: str, den: str, key: str, diff: bool = False) -> list[float]:
    out = []
    for rep in sorted({r["repeat"] for r in rows}):
        a = [r[key] for r in rows if r["repeat"] == rep and r["variant"] == num and key in r]
        b = [r[key] for r in rows if r["repeat"] == rep and r["variant"] == den and key in r]
        if a and b:
            out.append(a[0] - b[0] if diff else a[0] / b[0])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--epochs", type=int, default=40, help="epochs of the throughput jobs")
    p.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc_per_node)")
    p.add_argument("--skip", type=int, default=20, help="first steps left out of steady state")
    p.add_argument("--startup-steps", type=int, default=30,
                   help="trainer.max_steps of the first-step (startup) jobs")
    p.add_argument("--no-wandb", action="store_true", help="skip the logger=wandb variants")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--keep", action="store_true", help="keep the jobs' output dirs")
    p.add_argument("--out", type=Path, help="write every measurement here as JSON")
    p.add_argument("extra", nargs="*", help="extra overrides for our jobs (e.g. trainer.grad_clip=0)")
    args = p.parse_args()
    if args.skip % 10:
        p.error("--skip must be a multiple of the default trainer.log_interval (10)")

    variants = [v for v in VARIANTS if not (args.no_wandb and v.startswith("wandb"))]
    scratch = Path(tempfile.mkdtemp(prefix="bench_speed_", dir="/tmp"))
    git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "src", "conf"],
                           capture_output=True, text=True).stdout.strip()
    print(f"# bench_speed: {args.repeats} repeats x {variants}, nproc {args.nproc}, epochs "
          f"{args.epochs}, skip {args.skip}; commit {git}{' (src/conf modified)' if dirty else ''}"
          f"; load {os.getloadavg()[0]:.2f}; scratch {scratch}", flush=True)
    rows: list[dict] = []
    for rep in range(args.repeats):
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        for v in order:
            r = run_one(v, args, scratch, rep)
            rows.append(r)
            print("  " + json.dumps({k: round(x, 4) if isinstance(x, float) else x
                                     for k, x in r.items()}), flush=True)
    print(f"# load after: {os.getloadavg()[0]:.2f}")

    print("\n| variant | steady samples/s (median) | loop samples/s (median) | "
          "time to first step s (median) | command s (median) | runs |")
    print("|---|---|---|---|---|---|")
    for v in variants:
        n = sum(r["variant"] == v for r in rows)
        cells = [median(rows, v, k) for k in ("steady_sps", "loop_sps", "first_step_s",
                                               "command_s")]
        print(f"| {v} | " + " | ".join("-" if c != c else f"{c:,.1f}" if c > 100 else f"{c:.2f}"
                                       for c in cells) + f" | {n} |")

    results: dict = {"rows": rows, "commit": git, "dirty": bool(dirty)}
    print("\n| comparison | per-repeat values | median | target | verdict |")
    print("|---|---|---|---|---|")

    def line(name: str, vals: list[float], target: str, ok) -> None:
        med = statistics.median(vals) if vals else float("nan")
        verdict = "-" if ok is None else ("MET" if ok(med) else "MISSED")
        print(f"| {name} | {', '.join(f'{x:.3f}' for x in vals)} | {med:.3f} | {target} | "
              f"{verdict} |")
        results[name] = {"values": vals, "median": med, "verdict": verdict}

    line("steady samples/s ours/minimal", paired(rows, "ours", "minimal", "steady_sps"),
         ">= 0.95", lambda m: m >= 0.95)
    line("loop samples/s ours/minimal", paired(rows, "ours", "minimal", "loop_sps"), "-", None)
    line("first step ours - minimal (s)",
         paired(rows, "ours-startup", "minimal", "first_step_s", diff=True), "<= 2.0",
         lambda m: m <= 2.0)
    if not args.no_wandb:
        line("steady samples/s wandb/minimal", paired(rows, "wandb", "minimal", "steady_sps"),
             "(report)", None)
        line("steady samples/s wandb/ours", paired(rows, "wandb", "ours", "steady_sps"),
             "(report)", None)
        line("first step wandb - minimal (s)",
             paired(rows, "wandb-startup", "minimal", "first_step_s", diff=True), "(report)", None)
    print(f"\nratio of medians, steady ours/minimal: "
          f"{median(rows, 'ours', 'steady_sps') / median(rows, 'minimal', 'steady_sps'):.3f}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    if not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
