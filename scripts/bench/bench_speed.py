"""Benchmark: hydra_ddp's training loop against a hand-written minimal DDP loop.

    python scripts/bench/bench_speed.py                # 10 interleaved repeats, 2 ranks, 40 epochs
    python scripts/bench/bench_speed.py --repeats 15 --no-wandb --out /tmp/speed.json
    python scripts/bench/bench_speed.py --alt patched=/tmp/copy/src  # also time a patched checkout
    python scripts/bench/bench_speed.py --step-costs   # per-step cost: ours vs the minimal loop
    python scripts/bench/bench_speed.py --stop-cost    # ours with vs without the stop agreement

Every job is started the way a user starts it, with torchrun, from a scratch directory under
/tmp (so Hydra's outputs land there):

  minimal        torchrun --standalone --nproc_per_node=N scripts/bench/minimal_ddp.py --epochs E
                     (the same work per step as ours: model, AdamW groups, schedule, clipping)
  ours           torchrun --standalone --nproc_per_node=N -m hydra_ddp.train logger=none
                     trainer.progress=false trainer.epochs=E        (default job: model=mlp,
                     data=digits, batch 64 per rank, log_interval 10)
  ours-startup   the same with trainer.log_interval=1 trainer.max_steps=S (first step time)
  wandb          ours with logger=wandb (the default), W&B forced offline, its dirs isolated
  wandb-startup  likewise with trainer.log_interval=1 trainer.max_steps=S
  ours-noagree   (--stop-cost) ours started through scripts/bench/no_stop_agreement.py: the
                     same job without the ranks' stop agreement (StopOnSignal.agreed answers
                     from the rank's own flag, no all-reduce)
  ours-everystep (--stop-cost) likewise, with the ranks agreeing at every step (the default
                     agrees about every 0.1 s of steps): the agreement's cost undiluted.
                     --stop-cost runs only minimal, ours, ours-noagree and ours-everystep and
                     reports ours/ours-noagree and ours-everystep/ours-noagree

One repeat runs each variant once; the order rotates from repeat to repeat, so slow phases of a
shared machine hit every variant alike. Ratios are taken within a repeat and their median is
reported (plus the ratio of the medians).

What is measured (same definition for both loops, wall-clock stamps taken on rank 0):

* steady samples/s: global samples trained in steps skip+1 .. last (skip=20), divided by the
  time between the end of step `skip` and the end of the last step. Minimal: time.time()
  right after the step's sched.step() (end: right after the loop). Ours: the `time` field of
  stats/rank0.jsonl at those steps, stamped right after that step's stats were logged, so
  ours pays its logging inside the window. Samples: minimal counts them; ours reads
  samples_seen (per rank) x world size.
* window-median samples/s: the median over the 10-step windows after step `skip` of each
  window's samples/s (stamps every 10 steps, as above). Less sensitive to a burst of load
  from other processes inside one run.
* loop samples/s: all samples / (loop end - loop start), startup excluded, first steps
  included. Ours: summary.json samples_per_s; minimal: the same from its own stamps.
* CPU ms per 1k samples: user+system CPU time of all the job's worker processes (every
  thread, gloo's included; from psutil) between the moments the harness sees step `skip`
  and the last step reported (it polls every 10 ms), per 1000 global samples trained in
  between. A cost, not a speed: it does not count time a rank waits for a core or a peer.
* time to first step: from time.time() just before the torchrun subprocess is started to the
  moment rank 0 finished its first optimizer step. Minimal: its stamp. Ours: the first line
  of stats/rank0.jsonl in the ours-startup job (log_interval=1, so the line is written right
  after step 1 and its stats all_gather).
"""

from __future__ import annotations

import argparse
import itertools
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
MINIMAL = REPO / "scripts" / "bench" / "minimal_ddp.py"
NO_AGREEMENT = REPO / "scripts" / "bench" / "no_stop_agreement.py"
VARIANTS = ("minimal", "ours", "ours-startup", "wandb", "wandb-startup")
STOP_COST_VARIANTS = ("minimal", "ours", "ours-noagree", "ours-everystep")


def user_env(scratch: Path, wandb: bool, src: str | None = None) -> dict[str, str]:
    """A user's environment with no W&B login: offline, nothing read from $HOME."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("WANDB_", "TORCHELASTIC_", "SLURM_", "SUBMITIT_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        NETRC=str(scratch / "no-netrc"),
        WANDB_CONFIG_DIR=str(scratch / "wandb-config"),
        WANDB_CACHE_DIR=str(scratch / "wandb-cache"),
        WANDB_DATA_DIR=str(scratch / "wandb-data"),
        PYTHONUNBUFFERED="1",
    )
    if wandb:
        env["WANDB_MODE"] = "offline"
    if src:  # another checkout's hydra_ddp (and, through train.py's config_path, its conf/)
        env["PYTHONPATH"] = os.pathsep.join(x for x in (src, env.get("PYTHONPATH")) if x)
    return env


def command(variant: str, args: argparse.Namespace, run_dir: Path) -> list[str]:
    torchrun = [
        shutil.which("torchrun") or "torchrun",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
    ]
    if variant == "minimal":
        return torchrun + [str(MINIMAL), "--epochs", str(args.epochs), "--skip", str(args.skip)]
    shim = variant in ("ours-noagree", "ours-everystep")
    entry = [str(NO_AGREEMENT)] if shim else ["-m", "hydra_ddp.train"]
    cmd = torchrun + entry + ["trainer.progress=false", f"hydra.run.dir={run_dir}"]
    cmd.append("logger=wandb" if variant.startswith("wandb") else "logger=none")
    if variant.endswith("startup"):
        cmd += ["trainer.log_interval=1", f"trainer.max_steps={args.startup_steps}"]
    else:
        cmd += [f"trainer.epochs={args.epochs}"]
    return cmd + args.extra


class Monitor(threading.Thread):
    """Records the workers' CPU time whenever rank 0 reports progress.

    Ours: each new line of stats/rank0.jsonl; minimal: the lines it prints after step `skip`
    and at the end (read from its stdout). The monitor shares the two cores with the job, so
    it stays cheap: it stats the file every 10 ms and reads only what was appended, finds the
    worker processes once, and then reads just their /proc stat files.
    """

    def __init__(self, proc: subprocess.Popen, stats_file: Path | None):
        super().__init__(daemon=True)
        self.proc, self.stats_file = proc, stats_file
        self.cpu_at: dict = {}  # step (int) or "skip"/"end" -> CPU seconds of the workers
        self.stdout: list[str] = []
        self._workers: dict[int, psutil.Process] = {}
        self._cpu_done: dict[int, float] = {}

    def cpu(self) -> float:
        if not self._workers:
            try:
                for k in psutil.Process(self.proc.pid).children(recursive=True):
                    self._workers.setdefault(k.pid, k)
            except psutil.NoSuchProcess:
                pass
        total = 0.0
        for pid, k in self._workers.items():
            try:
                t = k.cpu_times()
                self._cpu_done[pid] = t.user + t.system
            except psutil.NoSuchProcess:
                pass
            total += self._cpu_done.get(pid, 0.0)
        return total

    def run(self) -> None:
        if self.stats_file is None:  # minimal: progress lines come on stdout
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if line.startswith("MINIMAL_DDP_SKIP"):
                    self.cpu_at["skip"] = self.cpu()
                elif line.startswith("MINIMAL_DDP "):
                    self.cpu_at["end"] = self.cpu()
                self.stdout.append(line)
            return
        offset, partial = 0, b""
        while True:
            done = self.proc.poll() is not None
            try:
                size = os.stat(self.stats_file).st_size
            except FileNotFoundError:
                size = 0
            if size > offset:
                cpu = self.cpu()
                with open(self.stats_file, "rb") as f:
                    f.seek(offset)
                    chunk = f.read(size - offset)
                offset += len(chunk)
                *lines, partial = (partial + chunk).split(b"\n")
                for line in lines:
                    self.cpu_at[json.loads(line)["step"]] = cpu
            if done:
                return
            time.sleep(0.01)


def run_one(variant: str, args: argparse.Namespace, scratch: Path, rep: int) -> dict:
    run_dir = scratch / "runs" / f"{variant}-{rep}"
    cmd = command(variant, args, run_dir)
    env = user_env(scratch, wandb=variant.startswith("wandb"), src=args.alt.get(variant))
    env["BENCH_STOP_AGREEMENT"] = "every_step" if variant == "ours-everystep" else "off"
    minimal = variant == "minimal"
    for attempt in range(args.retries + 1):
        shutil.rmtree(run_dir, ignore_errors=True)
        errlog = scratch / f"stderr-{variant}-{rep}-{attempt}.log"
        with open(errlog, "w") as err:
            t_launch = time.time()
            proc = subprocess.Popen(
                cmd,
                cwd=scratch,
                env=env,
                text=True,
                stderr=err,
                stdout=subprocess.PIPE if minimal else subprocess.DEVNULL,
            )
            mon = Monitor(proc, None if minimal else run_dir / "stats" / "rank0.jsonl")
            mon.start()
            try:
                rc = proc.wait(timeout=args.timeout)
            finally:
                if proc.poll() is None:
                    proc.kill()
                mon.join()
            t_exit = time.time()
        if rc == 0:
            errlog.unlink()
            break
        complete = (
            any(ln.startswith("MINIMAL_DDP ") for ln in mon.stdout)
            if minimal
            else (run_dir / "summary.json").exists()
        )
        if complete:  # the results were written: the job died tearing down (see the docs)
            print(
                f"  ! {variant} repeat {rep} exited rc {rc} after writing its results; "
                f"kept (stderr in {errlog})",
                flush=True,
            )
            break
        print(f"  ! {variant} repeat {rep} failed (rc {rc}); stderr in {errlog}", flush=True)
    else:
        raise SystemExit(f"{variant} failed {args.retries + 1} times; see {scratch}")
    out = {
        "variant": variant,
        "repeat": rep,
        "command_s": t_exit - t_launch,
        "attempts": attempt + 1,
        "rc": rc,
    }
    if minimal:
        line = next(ln for ln in mon.stdout if ln.startswith("MINIMAL_DDP "))
        m = json.loads(line.split(" ", 1)[1])
        world = m["world_size"]
        marks = {s: (t, n) for s, t, n in m["every10"]}  # step -> (time, samples per rank)
        marks[m["steps"]] = (m["loop_end"], m["samples_per_rank"])
        cpu = (mon.cpu_at.get("skip"), mon.cpu_at.get("end"))
        out["first_step_s"] = m["first_step"] - t_launch
        out["loop_sps"] = m["samples_per_rank"] * world / (m["loop_end"] - m["loop_start"])
    else:
        lines = [
            json.loads(ln) for ln in (run_dir / "stats" / "rank0.jsonl").read_text().splitlines()
        ]
        summary = json.loads((run_dir / "summary.json").read_text())
        world = summary["world_size"]
        if variant.endswith("startup"):
            assert lines[0]["step"] == 1, lines[0]
            out["first_step_s"] = lines[0]["time"] - t_launch
            out["steps"] = lines[-1]["step"]
            _cleanup(args, run_dir)
            return out
        marks = {row["step"]: (row["time"], row["samples_seen"]) for row in lines}
        cpu = (mon.cpu_at.get(args.skip), mon.cpu_at.get(lines[-1]["step"]))
        out["loop_sps"] = summary["samples_per_s"]
    steps = sorted(s for s in marks if s >= args.skip)
    if not steps or steps[0] != args.skip:
        raise SystemExit(
            f"{variant}: no stamp at step {args.skip} (--skip must be a multiple "
            "of trainer.log_interval)"
        )
    (t0, n0), (t1, n1) = marks[args.skip], marks[steps[-1]]
    out["steps"] = steps[-1]
    out["steady_sps"] = (n1 - n0) * world / (t1 - t0)
    windows = [
        (marks[b][1] - marks[a][1]) * world / (marks[b][0] - marks[a][0])
        for a, b in zip(steps, steps[1:])
    ]
    out["window_median_sps"] = statistics.median(windows)
    if None not in cpu:
        out["cpu_ms_per_1k"] = (cpu[1] - cpu[0]) * 1e6 / ((n1 - n0) * world)
    _cleanup(args, run_dir)
    return out


def _cleanup(args: argparse.Namespace, run_dir: Path) -> None:
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)


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


# --------------------------------------------------------------------------------------------
# --step-costs: one process, no DDP, CPU time per step of each loop's data path and step
# --------------------------------------------------------------------------------------------


def step_costs(rounds: int) -> None:
    """Per-step CPU time of rank 0's work in the default job (model=mlp, data=digits, fp32,
    grad_accum 1, grad_clip 1.0, a 2 ranks' partition) and in the minimal loop, data loading
    included, without DDP: one thread, interleaved rounds. Ours is the package's public pieces
    as train.py's loop calls them (TrainData batches, `train_step`, the non-finite check,
    `sched.step()`; its per-interval stats window is left out); the minimal loop is
    minimal_ddp.py's body. Both do the same work: same model, fused AdamW over `param_groups`,
    `warmup_cosine`, clip_grad_norm_(1.0)."""
    import contextlib

    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from hydra_ddp.data import Digits, Strided, TrainData
    from hydra_ddp.distributed import DistEnv
    from hydra_ddp.losses import CrossEntropy
    from hydra_ddp.models import MLP
    from hydra_ddp.optim import param_groups, warmup_cosine
    from hydra_ddp.step import train_step

    torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS=1
    env = DistEnv(rank=0, world_size=2)
    source = Digits(val_fraction=0.15, test_fraction=0.15, split_seed=0)

    def minimal_batches():
        # minimal_ddp.py's data path: the same train rows in a TensorDataset behind a
        # DistributedSampler and a collating DataLoader.
        dataset = TensorDataset(*(torch.from_numpy(a) for a in source.arrays["train"]))
        sampler = DistributedSampler(dataset, num_replicas=2, rank=0, seed=0)
        loader = DataLoader(dataset, batch_size=64, sampler=sampler)
        for epoch in itertools.count():
            sampler.set_epoch(epoch)
            yield from loader

    def our_batches():
        data = TrainData(source, Strided(True, 0, False), env, 64, 0)
        for epoch in itertools.count():
            yield from data.epoch(epoch)

    class Loop:
        def __init__(self, minimal: bool = False, minimal_data: bool = False):
            torch.manual_seed(0)
            self.m = MLP(in_features=64, out_features=10, hidden=256, depth=2, dropout=0.1)
            if minimal:  # minimal_ddp.py's model is this nn.Sequential without the flatten
                self.m = self.m.net
            self.batches = minimal_batches() if minimal or minimal_data else our_batches()
            self.opt = torch.optim.AdamW(
                param_groups(self.m), lr=0.002, betas=(0.9, 0.999), weight_decay=0.01, fused=True
            )
            self.sched = warmup_cosine(self.opt, 10**6, warmup_steps=20, min_lr_ratio=0.1)
            self.loss_fn = torch.nn.CrossEntropyLoss() if minimal else CrossEntropy(0.0)
            self.scaler = torch.amp.GradScaler("cpu", enabled=False)
            self.minimal = minimal

        def step(self) -> None:
            if self.minimal:  # minimal_ddp.py's loop body
                xb, yb = next(self.batches)
                loss = self.loss_fn(self.m(xb), yb)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.m.parameters(), 1.0)
                self.opt.step()
                self.sched.step()
                return
            # train.py's loop body around train_step (fp32: no autocast context, scaler off)
            batch = [tuple(t.to("cpu", non_blocking=True) for t in next(self.batches))]
            _, grad_norm = train_step(
                self.m, batch, self.loss_fn, self.opt, self.scaler, contextlib.nullcontext(), 1.0
            )
            if not self.scaler.is_enabled() and not torch.isfinite(grad_norm):
                raise RuntimeError("non-finite gradients")
            self.sched.step()

    variants = {
        "minimal loop": {"minimal": True},
        "ours (TrainData + train_step)": {},
        "ours with the minimal loop's DataLoader": {"minimal_data": True},
    }
    loops = {k: Loop(**kw) for k, kw in variants.items()}
    res: dict[str, list[float]] = {k: [] for k in loops}
    names = list(loops)
    for r in range(rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            for _ in range(3):
                loops[k].step()
            t = time.thread_time()
            for _ in range(30):
                loops[k].step()
            res[k].append((time.thread_time() - t) / 30 * 1e6)
    base = statistics.median(res["minimal loop"])
    full = statistics.median(res["ours (TrainData + train_step)"])
    print(f"# per-step CPU time (one thread, no DDP, batch 64), median of {rounds} rounds")
    print("| loop | us/step | vs ours | minimal/this |")
    print("|---|---|---|---|")
    for k, v in res.items():
        m = statistics.median(v)
        print(f"| {k} | {m:.0f} | {m - full:+.0f} | {base / m:.3f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--epochs", type=int, default=40, help="epochs of the throughput jobs")
    p.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc_per_node)")
    p.add_argument("--skip", type=int, default=20, help="first steps left out of steady state")
    p.add_argument(
        "--startup-steps",
        type=int,
        default=30,
        help="trainer.max_steps of the first-step (startup) jobs",
    )
    p.add_argument("--no-wandb", action="store_true", help="skip the logger=wandb variants")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--retries", type=int, default=2, help="reruns of a job that failed")
    p.add_argument("--keep", action="store_true", help="keep the jobs' output dirs")
    p.add_argument("--out", type=Path, help="write every measurement here as JSON")
    p.add_argument(
        "--alt",
        action="append",
        default=[],
        metavar="NAME=SRC",
        help="also time our loop from another source tree (a patched copy's src/ "
        "dir) as variant NAME, logger=none, interleaved like the others",
    )
    p.add_argument(
        "--step-costs",
        type=int,
        nargs="?",
        const=80,
        metavar="ROUNDS",
        help="instead: time the loop body's pieces in one process (no torchrun)",
    )
    p.add_argument(
        "--stop-cost",
        action="store_true",
        help="instead: minimal, ours and ours without the ranks' stop agreement "
        "(scripts/bench/no_stop_agreement.py), interleaved; reports ours/ours-noagree",
    )
    p.add_argument(
        "extra", nargs="*", help="extra overrides for our jobs (e.g. trainer.grad_clip=0)"
    )
    args = p.parse_args()
    if args.step_costs:
        step_costs(args.step_costs)
        return 0
    if args.skip % 10:
        p.error("--skip must be a multiple of the default trainer.log_interval (10)")

    variants = [v for v in VARIANTS if not (args.no_wandb and v.startswith("wandb"))]
    if args.stop_cost:
        variants, args.no_wandb = list(STOP_COST_VARIANTS), True
    args.alt = dict(a.split("=", 1) for a in args.alt)
    variants += list(args.alt)
    scratch = Path(tempfile.mkdtemp(prefix="bench_speed_", dir="/tmp"))
    git = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "src", "conf"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    print(
        f"# bench_speed: {args.repeats} repeats x {variants}, nproc {args.nproc}, epochs "
        f"{args.epochs}, skip {args.skip}; commit {git}{' (src/conf modified)' if dirty else ''}"
        f"; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; scratch {scratch}",
        flush=True,
    )
    rows: list[dict] = []
    for rep in range(args.repeats):
        order = variants[rep % len(variants) :] + variants[: rep % len(variants)]
        for v in order:
            r = run_one(v, args, scratch, rep)
            rows.append(r)
            print(
                "  "
                + json.dumps({k: round(x, 4) if isinstance(x, float) else x for k, x in r.items()}),
                flush=True,
            )
    print(f"# load after: {os.getloadavg()[0]:.2f}")

    keys = (
        "steady_sps",
        "window_median_sps",
        "loop_sps",
        "cpu_ms_per_1k",
        "first_step_s",
        "command_s",
    )
    print(
        "\n| variant | steady samples/s | window-median samples/s | loop samples/s | "
        "CPU ms / 1k samples | time to first step s | command s | runs |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for v in variants:
        n = sum(r["variant"] == v for r in rows)
        cells = [median(rows, v, k) for k in keys]
        print(
            f"| {v} | "
            + " | ".join("-" if c != c else f"{c:,.0f}" if c > 1000 else f"{c:.2f}" for c in cells)
            + f" | {n} |"
        )
    print("(medians over the repeats)")

    results: dict = {"rows": rows, "commit": git, "dirty": bool(dirty)}
    print("\n| comparison | per-repeat values | median | target | verdict |")
    print("|---|---|---|---|---|")

    def line(name: str, vals: list[float], target: str, ok) -> None:
        med = statistics.median(vals) if vals else float("nan")
        verdict = "-" if ok is None else ("MET" if ok(med) else "MISSED")
        print(
            f"| {name} | {', '.join(f'{x:.3f}' for x in vals)} | {med:.3f} | {target} | {verdict} |"
        )
        results[name] = {"values": vals, "median": med, "verdict": verdict}

    def speed_lines(num: str, den: str, target: str, ok) -> None:
        line(f"steady samples/s {num}/{den}", paired(rows, num, den, "steady_sps"), target, ok)
        line(
            f"window-median samples/s {num}/{den}",
            paired(rows, num, den, "window_median_sps"),
            "(report)",
            None,
        )
        line(f"loop samples/s {num}/{den}", paired(rows, num, den, "loop_sps"), "(report)", None)
        line(
            f"CPU per sample {den}/{num}", paired(rows, den, num, "cpu_ms_per_1k"), "(report)", None
        )

    speed_lines("ours", "minimal", ">= 0.95", lambda m: m >= 0.95)
    if args.stop_cost:
        speed_lines("ours", "ours-noagree", "(report: 1.0 = free)", None)
        speed_lines("ours-everystep", "ours-noagree", "(report)", None)
    else:
        line(
            "first step ours - minimal (s)",
            paired(rows, "ours-startup", "minimal", "first_step_s", diff=True),
            "<= 2.0",
            lambda m: m <= 2.0,
        )
    for name in args.alt:
        speed_lines(name, "minimal", "(report)", None)
        line(
            f"steady samples/s {name}/ours",
            paired(rows, name, "ours", "steady_sps"),
            "(report)",
            None,
        )
        line(
            f"CPU per sample ours/{name}",
            paired(rows, "ours", name, "cpu_ms_per_1k"),
            "(report)",
            None,
        )
    if not args.no_wandb:
        speed_lines("wandb", "minimal", "(report)", None)
        line(
            "first step wandb - minimal (s)",
            paired(rows, "wandb-startup", "minimal", "first_step_s", diff=True),
            "(report)",
            None,
        )
    print(
        f"\nratio of medians, steady ours/minimal: "
        f"{median(rows, 'ours', 'steady_sps') / median(rows, 'minimal', 'steady_sps'):.3f}"
    )
    if args.stop_cost:
        base = median(rows, "ours-noagree", "steady_sps")
        print(
            f"ratio of medians, steady ours/ours-noagree: "
            f"{median(rows, 'ours', 'steady_sps') / base:.3f}, ours-everystep/ours-noagree: "
            f"{median(rows, 'ours-everystep', 'steady_sps') / base:.3f}"
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    if not args.keep and not list(scratch.glob("stderr-*.log")):
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
