"""Training steps and result of a pruned Optuna sweep against the same sweep unpruned: the
commands a user types (`-m hparams_search=digits_optuna_pruned`), the unpruned one with
Optuna's NopPruner in place of the preset's pruner, everything else equal (sampler and seed,
trials, steps, evaluations). Variants alternate, so a change in the machine's load hits both.

    python scripts/bench/bench_pruning.py                       # 16 trials, 300 steps, seed 1234
    python scripts/bench/bench_pruning.py --trials 16 --steps 300 --seeds 1234 7 --out p.json
    python scripts/bench/bench_pruning.py --pruner successive_halving \
        --pruner-set reduction_factor=2

Per variant: the training steps of all trials (summary.json's `steps`), the wall time, the best
value and, for the unpruned sweep, the spread (standard deviation) of its trials' final values.
The target: pruned steps <= 0.5x unpruned, and the pruned best within one spread of the
unpruned best. Results go in docs/benchmarks.md with the exact command and the machine's load.
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

NO_PRUNER = ["~hydra/sweeper/pruner", "+hydra.sweeper.pruner={_target_:optuna.pruners.NopPruner}"]


def sweep_command(pruned: bool, args: argparse.Namespace, seed: int) -> list[str]:
    cmd = [sys.executable, "-m", "hydra_ddp.train", "-m", "hparams_search=digits_optuna_pruned"]
    cmd += ["logger=none", "trainer.progress=false", "trainer.log_interval=1000"]
    cmd += [f"trainer.max_steps={args.steps}", f"trainer.eval_interval={args.steps // 10}"]
    cmd += [f"hydra.sweeper.n_trials={args.trials}", f"hydra.sweeper.sampler.seed={seed}"]
    if not pruned:
        cmd += NO_PRUNER
    else:
        cmd += [f"hydra/sweeper/pruner={args.pruner}"] if args.pruner else []
        cmd += [f"hydra.sweeper.pruner.{setting}" for setting in args.pruner_set]
    return cmd


def run_once(pruned: bool, args: argparse.Namespace, seed: int) -> dict:
    name = "pruned" if pruned else "unpruned"
    with tempfile.TemporaryDirectory(prefix=f"bench_pruning_{name}_") as tmp:
        cmd = sweep_command(pruned, args, seed)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.setdefault("OMP_NUM_THREADS", "1")
        load = os.getloadavg()[0]
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
        wall = time.monotonic() - start
        if proc.returncode != 0:
            sys.exit(f"{name} sweep failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        report = json.loads(next(Path(tmp).rglob("sweep_report.json")).read_text())
        finished = [j["objective"] for j in report if j["status"] == "ok"]
        return {
            "variant": name,
            "seed": seed,
            "wall_s": wall,
            "steps": sum(j["steps"] or 0 for j in report),
            "pruned": sum(j["status"] == "PRUNED" for j in report),
            "failed": sum(j["status"] not in ("ok", "PRUNED") for j in report),
            "best": max(finished) if finished else None,
            "finished_values": finished,
            "load_before": load,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--steps", type=int, default=300, help="trainer.max_steps of each trial")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234], help="sampler seeds")
    parser.add_argument("--pruner", default=None, help="median or successive_halving")
    parser.add_argument(
        "--pruner-set",
        nargs="*",
        default=[],
        help="KEY=VALUE of the pruner, e.g. reduction_factor=2",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    print(f"{args.trials} trials x {args.steps} steps; seeds {args.seeds}; {os.cpu_count()} CPUs")
    runs = []
    for i, seed in enumerate(args.seeds):
        for pruned in (True, False) if i % 2 == 0 else (False, True):
            r = run_once(pruned, args, seed)
            runs.append(r)
            print(
                f"seed {seed}: {r['variant']:8s} {r['steps']:6d} steps, {r['wall_s']:6.1f} s, "
                f"{r['pruned']} pruned, {r['failed']} failed, best {r['best']}, "
                f"load {r['load_before']:.1f} before"
            )
    for seed in args.seeds:
        p, u = (next(r for r in runs if r["seed"] == seed and r["variant"] == v) for v in
                ("pruned", "unpruned"))  # fmt: skip
        spread = statistics.pstdev(u["finished_values"])
        gap = u["best"] - p["best"]
        print(
            f"seed {seed}: steps pruned/unpruned {p['steps'] / u['steps']:.2f} (target <= 0.5); "
            f"wall {p['wall_s'] / u['wall_s']:.2f}; best {p['best']:.4f} vs {u['best']:.4f}, "
            f"gap {gap:.4f} vs the unpruned trials' spread (std) {spread:.4f} "
            f"({'within' if gap <= spread else 'outside'})"
        )
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": runs}))


if __name__ == "__main__":
    main()
