"""Benchmark: what logger=wandb (offline) costs the default job's throughput, against logger=none.

    python scripts/bench/bench_logger_overhead.py            # 7 interleaved pairs
    python scripts/bench/bench_logger_overhead.py --repeats 9 --out /tmp/logger.json

Each job is the default job as a user starts it, from a scratch directory under /tmp:

    torchrun --standalone --nproc_per_node=2 -m hydra_ddp.train trainer.progress=false \\
        trainer.log_interval=10 logger=none|wandb

(default config otherwise: model=mlp, data=digits, 40 epochs = 400 steps, batch 64 per
rank). W&B runs offline (WANDB_MODE=offline) with WANDB_CONFIG_DIR, WANDB_CACHE_DIR,
WANDB_DATA_DIR and NETRC pointed into the scratch directory, so no login or file of the
machine's user is read. The figure compared is summary.json's samples_per_s: all samples
trained / the training loop's wall time, which leaves out start-up (Hydra, imports, the
process group, wandb.init) and the end (evaluation, checkpoint, wandb.finish). The pairs run
alternately (none, wandb, wandb, none, ...), the ratio wandb/none is taken within each pair
and the median of those ratios is the result. Target: >= 0.97 (within 3%).
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

import bench_speed  # scripts/bench/ is on sys.path when this file runs as a script


def user_env(scratch: Path, wandb: bool, extra: dict[str, str] | None = None) -> dict[str, str]:
    """bench_speed's isolated no-login environment, plus extra W&B settings for diagnosis."""
    env = bench_speed.user_env(scratch, wandb)
    if wandb:
        env.update(extra or {})
    return env


def run_job(variant: str, args: argparse.Namespace, scratch: Path, rep: int) -> dict:
    logger = "none" if variant == "none" else "wandb"
    run_dir = scratch / "runs" / f"{variant}-{rep}"
    cmd = [
        shutil.which("torchrun") or "torchrun",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        "-m",
        "hydra_ddp.train",
        "trainer.progress=false",
        f"trainer.log_interval={args.log_interval}",
        f"logger={logger}",
        f"hydra.run.dir={run_dir}",
    ] + args.extra
    for attempt in range(args.retries + 1):
        shutil.rmtree(run_dir, ignore_errors=True)
        t0 = time.time()
        extra = args.wandb_env if variant == "wandb+env" else None
        proc = subprocess.run(
            cmd,
            cwd=scratch,
            env=user_env(scratch, logger == "wandb", extra),
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
        wall = time.time() - t0
        if proc.returncode == 0:
            break
        log = scratch / f"failed-{variant}-{rep}-{attempt}.log"
        log.write_text(f"{' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
        if (run_dir / "summary.json").exists():  # died tearing down, results complete
            print(
                f"  ! {variant} repeat {rep} exited rc {proc.returncode} after writing "
                f"summary.json; kept (output in {log})",
                flush=True,
            )
            break
        print(
            f"  ! {variant} repeat {rep} failed (rc {proc.returncode}); output in {log}", flush=True
        )
    else:
        raise SystemExit(f"{variant} failed {args.retries + 1} times; see {scratch}")
    summary = json.loads((run_dir / "summary.json").read_text())
    out = {
        "logger": variant,
        "repeat": rep,
        "samples_per_s": summary["samples_per_s"],
        "wall_time_s": summary["wall_time_s"],
        "command_s": wall,
        "steps": summary["steps"],
        "attempts": attempt + 1,
        "rc": proc.returncode,
    }
    if logger == "wandb":
        offline = list((run_dir / "wandb").glob("offline-run-*"))
        out["offline_runs"] = len(offline)  # proves W&B really ran (offline)
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7, help="pairs (none, wandb)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--retries", type=int, default=2)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--out", type=Path)
    p.add_argument(
        "--wandb-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="diagnosis: add a third job per repeat, 'wandb+env', with these W&B "
        "environment settings (e.g. WANDB_CONSOLE=off, WANDB_X_DISABLE_STATS=true)",
    )
    p.add_argument("extra", nargs="*", help="extra overrides for both jobs")
    args = p.parse_args()
    args.wandb_env = dict(kv.split("=", 1) for kv in args.wandb_env)
    loggers = ["none", "wandb"] + (["wandb+env"] if args.wandb_env else [])

    scratch = Path(tempfile.mkdtemp(prefix="bench_logger_", dir="/tmp"))
    print(
        f"# bench_logger_overhead: {args.repeats} pairs, nproc {args.nproc}, log_interval "
        f"{args.log_interval}; load {os.getloadavg()[0]:.2f}; scratch {scratch}",
        flush=True,
    )
    rows = []
    for rep in range(args.repeats):
        order = loggers if rep % 2 == 0 else loggers[::-1]
        for logger in order:
            r = run_job(logger, args, scratch, rep)
            rows.append(r)
            print(
                "  "
                + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}),
                flush=True,
            )
    print(f"# load after: {os.getloadavg()[0]:.2f}")
    by = {(r["logger"], r["repeat"]): r for r in rows}
    ratios = [
        by["wandb", i]["samples_per_s"] / by["none", i]["samples_per_s"]
        for i in range(args.repeats)
    ]
    med = {
        lg: statistics.median(r["samples_per_s"] for r in rows if r["logger"] == lg)
        for lg in loggers
    }
    ratio = statistics.median(ratios)
    verdict = "MET" if ratio >= 0.97 else "MISSED"
    print("\n| logger | samples/s per repeat | median samples/s | median loop wall s |")
    print("|---|---|---|---|")
    for lg in loggers:
        vals = [r["samples_per_s"] for r in rows if r["logger"] == lg]
        walls = [r["wall_time_s"] for r in rows if r["logger"] == lg]
        print(
            f"| {lg} | {', '.join(f'{v:,.0f}' for v in vals)} | {med[lg]:,.0f} | "
            f"{statistics.median(walls):.3f} |"
        )
    print(f"\nper-pair ratio wandb/none: {', '.join(f'{x:.3f}' for x in ratios)}")
    print(
        f"median of pair ratios {ratio:.3f} (ratio of medians {med['wandb'] / med['none']:.3f});"
        f" target >= 0.97: {verdict}"
    )
    if args.wandb_env:
        env_ratios = [
            by["wandb+env", i]["samples_per_s"] / by["none", i]["samples_per_s"]
            for i in range(args.repeats)
        ]
        print(
            f"wandb+env ({' '.join(f'{k}={v}' for k, v in args.wandb_env.items())}) / none: "
            f"{', '.join(f'{x:.3f}' for x in env_ratios)}; median "
            f"{statistics.median(env_ratios):.3f}"
        )
    if args.out:
        args.out.write_text(
            json.dumps(
                {"rows": rows, "ratios": ratios, "median_ratio": ratio, "verdict": verdict},
                indent=2,
            )
            + "\n"
        )
    if not args.keep and not list(scratch.glob("failed-*.log")):
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
