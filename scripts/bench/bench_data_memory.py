"""Benchmark: how much memory N ranks need for a data set bigger than 1 GiB, per sampling policy.

    python scripts/bench/bench_data_memory.py                   # makes the data set if missing
    python scripts/bench/bench_data_memory.py --repeats 2 --out /tmp/mem.json

It trains one epoch of model=mlp on a synthetic data set (written by scripts/make_synthetic.py
--size-gib 1.1 --features 256 --shards 8 under /tmp) with 2 ranks under torchrun, for:

  baseline        data=digits (1,257 tiny rows): a worker that imported everything and built
                  the model but holds no data to speak of
  strided-mem     sampler=strided data.in_memory=true    (every rank copies the whole split)
  strided-mmap    sampler=strided data.in_memory=false   (every rank maps the files)
  sharded-mem     sampler=sharded data.in_memory=true    (every rank copies its part)
  sharded-mmap    sampler=sharded data.in_memory=false   (every rank maps its part)

While a job runs, the proportional set size (PSS: private pages plus each shared page divided by
the number of processes mapping it, from /proc/<pid>/smaps_rollup) of every descendant of the
torchrun process (the ranks; the agent itself holds no data) is sampled every --interval
seconds, and the peak of the sum is kept. PSS is the number that adds up: two ranks mapping
the same file page count it once between them, two private copies count twice. The peak
covers the whole job: loading, one full epoch (every rank touches all of its rows), the final
evaluation of the val/test splits and the checkpoint.

Verdict (the issue's target): for sharded (both) and strided-mmap, peak PSS sum <= 1.15 x D +
ranks x baseline, with D the training split's size on disk (x and y) and baseline the peak
per-rank PSS of the baseline job of the same repeat. strided-mem is expected to cost about
ranks x D; its line says how many D it costs. The per-rank rows and bytes summary.json
reports (rows_held_per_rank, bytes_held_per_rank) are checked against what each policy should
hold.
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
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
GiB = 2**30
CONFIGS = {
    "baseline": ["data=digits"],
    "strided-mem": ["sampler=strided", "data.in_memory=true"],
    "strided-mmap": ["sampler=strided", "data.in_memory=false"],
    "sharded-mem": ["sampler=sharded", "data.in_memory=true"],
    "sharded-mmap": ["sampler=sharded", "data.in_memory=false"],
}


def smaps_rollup(pid: int) -> dict[str, int]:
    """Pss, Rss, Private_* ... of one process in bytes (0s if it is gone)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out


class Sampler(threading.Thread):
    """Samples the PSS of every descendant of `root` until stopped."""

    def __init__(self, root: int, interval: float, stats_file: Path):
        super().__init__(daemon=True)
        self.root, self.interval, self.stats_file = root, interval, stats_file
        self.stop = threading.Event()
        self.samples: list[dict] = []

    def run(self) -> None:
        try:
            parent = psutil.Process(self.root)
        except psutil.NoSuchProcess:
            return
        while not self.stop.is_set():
            try:
                kids = parent.children(recursive=True)
            except psutil.NoSuchProcess:
                break
            per = {k.pid: smaps_rollup(k.pid) for k in kids}
            per = {pid: m for pid, m in per.items() if m}
            if per:
                training = self.stats_file.exists() and self.stats_file.stat().st_size > 0
                self.samples.append(
                    {
                        "t": time.time(),
                        "training": training,
                        "procs": len(per),
                        "pss": sum(m.get("Pss", 0) for m in per.values()),
                        "private": sum(
                            m.get("Private_Clean", 0) + m.get("Private_Dirty", 0)
                            for m in per.values()
                        ),
                        "rss": sum(m.get("Rss", 0) for m in per.values()),
                        "pss_per_proc": sorted(m.get("Pss", 0) for m in per.values()),
                    }
                )
            self.stop.wait(self.interval)


def user_env(scratch: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("WANDB_", "TORCHELASTIC_", "SLURM_", "SUBMITIT_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(NETRC=str(scratch / "no-netrc"), WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    return env


def run_job(name: str, args: argparse.Namespace, scratch: Path, rep: int) -> dict:
    run_dir = scratch / "runs" / f"{name}-{rep}"
    cmd = [
        shutil.which("torchrun") or "torchrun",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        "-m",
        "hydra_ddp.train",
        "model=mlp",
        "logger=none",
        "trainer.progress=false",
        "trainer.epochs=1",
        f"trainer.batch_size={args.batch_size}",
        f"hydra.run.dir={run_dir}",
    ]
    if name != "baseline":
        cmd += ["data=synthetic", f"data.path={args.data}"]
    cmd += CONFIGS[name]
    t0 = time.time()
    with open(scratch / f"{name}-{rep}.log", "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=scratch, env=user_env(scratch), stdout=log, stderr=subprocess.STDOUT
        )
        sampler = Sampler(proc.pid, args.interval, run_dir / "stats" / "rank0.jsonl")
        sampler.start()
        try:
            rc = proc.wait(timeout=args.timeout)
        finally:
            sampler.stop.set()
            sampler.join()
            if proc.poll() is None:
                proc.kill()
    if rc != 0 and (run_dir / "summary.json").exists():
        print(f"  ! {name} exited rc {rc} after writing summary.json (teardown); kept", flush=True)
    elif rc != 0:
        raise SystemExit(f"{name} failed (rc {rc}); see {scratch / f'{name}-{rep}.log'}")
    s = sampler.samples
    if not s:
        raise SystemExit(f"{name}: no PSS sample was taken")
    summary = json.loads((run_dir / "summary.json").read_text())
    peak = max(s, key=lambda x: x["pss"])
    train = [x["pss"] for x in s if x["training"]]
    out = {
        "config": name,
        "repeat": rep,
        "rc": rc,
        "wall_s": time.time() - t0,
        "samples": len(s),
        "procs": max(x["procs"] for x in s),
        "peak_pss": peak["pss"],
        "peak_pss_per_proc": peak["pss_per_proc"],
        "peak_private": peak["private"],
        "peak_rss": peak["rss"],
        "training_median_pss": statistics.median(train) if train else None,
        "rows_held_per_rank": summary["rows_held_per_rank"],
        "bytes_held_per_rank": summary["bytes_held_per_rank"],
        "epochs": summary["epochs"],
        "steps": summary["steps"],
    }
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


def data_size(root: Path) -> dict:
    manifest = json.loads((root / "manifest.json").read_text())
    split = {}
    for name, files in manifest["splits"].items():
        split[name] = {
            "rows": sum(f["rows"] for f in files),
            "bytes": sum(
                (root / f["x"]).stat().st_size + (root / f["y"]).stat().st_size for f in files
            ),
            "data_bytes": sum(f["rows"] * (4 * manifest["features"] + 2) for f in files),
        }
    return split


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=Path("/tmp/hydra_ddp_synthetic_1.1gib"))
    p.add_argument("--size-gib", type=float, default=1.1)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4096, help="per rank")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between PSS samples")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    if not (args.data / "manifest.json").exists():
        print(f"# writing the data set to {args.data}", flush=True)
        subprocess.run(
            [
                sys.executable,
                str(REPO / "scripts" / "make_synthetic.py"),
                "--out",
                str(args.data),
                "--size-gib",
                str(args.size_gib),
                "--features",
                "256",
                "--shards",
                "8",
            ],
            check=True,
        )
    sizes = data_size(args.data)
    D = sizes["train"]["data_bytes"]  # x and y of the training split (the .npy headers aside)
    n_train = sizes["train"]["rows"]
    total_disk = sum(v["bytes"] for v in sizes.values())
    print(
        f"# data set {args.data}: train {n_train} rows, D = {D / GiB:.3f} GiB; "
        f"val+test {(total_disk - sizes['train']['bytes']) / GiB:.3f} GiB; all files "
        f"{total_disk / GiB:.3f} GiB",
        flush=True,
    )
    configs = args.configs.split(",")
    scratch = Path(tempfile.mkdtemp(prefix="bench_mem_", dir="/tmp"))
    rows: list[dict] = []
    for rep in range(args.repeats):
        for name in configs:  # baseline first: every repeat has its own
            r = run_job(name, args, scratch, rep)
            rows.append(r)
            print(
                "  "
                + json.dumps(
                    {
                        k: (round(v / GiB, 3) if isinstance(v, (int, float)) and v > 2**20 else v)
                        for k, v in r.items()
                        if k not in ("peak_pss_per_proc", "bytes_held_per_rank")
                    }
                ),
                flush=True,
            )

    W = args.nproc
    base = {r["repeat"]: r["peak_pss"] / W for r in rows if r["config"] == "baseline"}
    base_all = statistics.median(base.values()) if base else 0.0
    expect_rows = {
        "strided": [n_train] * W,
        "sharded": [(r + 1) * n_train // W - r * n_train // W for r in range(W)],
    }
    print(
        f"\nbaseline (digits, same model): peak PSS per rank, median {base_all / GiB:.3f} GiB "
        f"({', '.join(f'{b / GiB:.3f}' for b in base.values())})"
    )
    print(
        "\n| config | peak PSS sum GiB | per rank GiB | training median GiB | (peak - ranks x "
        "baseline) / D | limit GiB (1.15 D + ranks x baseline) | rows held per rank | "
        "bytes held per rank GiB | verdict |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    results: dict = {
        "D": D,
        "train_rows": n_train,
        "baseline_per_rank": base_all,
        "rows": rows,
        "verdicts": {},
    }
    for name in configs:
        if name == "baseline":
            continue
        runs = [r for r in rows if r["config"] == name]
        peak = statistics.median(r["peak_pss"] for r in runs)
        b = statistics.median(base.get(r["repeat"], base_all) for r in runs)
        limit = 1.15 * D + W * b
        over = (peak - W * b) / D
        held_rows = runs[0]["rows_held_per_rank"]
        held_bytes = runs[0]["bytes_held_per_rank"]
        want = expect_rows["strided" if name.startswith("strided") else "sharded"]
        rows_ok = held_rows == want
        if name == "strided-mem":
            verdict = f"costs {over:.2f} x D (expected ~{W} x D)" + (
                "" if rows_ok else "; ROWS WRONG"
            )
        else:
            ok = peak <= limit and rows_ok
            verdict = ("MET" if ok else "MISSED") + (
                "" if rows_ok else f" (rows held {held_rows}, expected {want})"
            )
        results["verdicts"][name] = {
            "peak": peak,
            "limit": limit,
            "over_D": over,
            "verdict": verdict,
        }
        training = [r["training_median_pss"] for r in runs if r["training_median_pss"]]
        tr = f"{statistics.median(training) / GiB:.3f}" if training else "-"
        per = ", ".join(f"{x / GiB:.3f}" for x in runs[0]["peak_pss_per_proc"])
        print(
            f"| {name} | {peak / GiB:.3f} | {per} | {tr} | {over:.2f} | {limit / GiB:.3f} | "
            f"{', '.join(map(str, held_rows))} | "
            f"{', '.join(f'{x / GiB:.3f}' for x in held_bytes)} | {verdict} |"
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    if not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
