"""A stand-in training job for tests/test_tracking.py, run under torchrun (or as one process).

It logs synthetic stats in which rank 1 is the straggler (slower steps, less data wait), so the
tests can check the cross-rank aggregates. A `UserError` is reported the way the entry point
does (one line on stderr, exit status 2), plus a marker file per rank so the test can tell that
*every* rank failed on its own rather than being torn down by torchrun.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hydra_ddp.config import Layout, LoggerBackend, LoggerConfig, WandbMode
from hydra_ddp.dist import DistEnv
from hydra_ddp.errors import UserError
from hydra_ddp.tracking import RunInfo, make_tracker


def fake_stats(step: int, rank: int) -> dict[str, float]:
    """Stats shaped like the trainer's, with rank 1 slower and using more memory."""
    return {
        "loss": 2.0 / step + 0.01 * rank,
        "step_time": 0.10 + 0.05 * rank + 0.001 * step,
        "data_wait": 0.02 - 0.01 * rank,
        "samples_per_s": 640.0 - 100.0 * rank,
        "rss_mb": 500.0 + 80.0 * rank + step,
        "peak_rss_mb": 520.0 + 80.0 * rank + step,
        "cuda_mem_mb": 0.0,
        "samples_seen": 64 * step,
        "grad_norm": 1.0 / step,
        "lr": 0.1,
    }


def run_job(args: argparse.Namespace, env: DistEnv, out: Path, job_name: str, fail: bool) -> None:
    """One job: build a tracker, log a few intervals, evaluate, close."""
    cfg = LoggerConfig(
        backend=LoggerBackend(args.backend),
        layout=Layout(args.layout),
        mode=WandbMode(args.mode),
        project="hydra-ddp-tests",
        tags=["test", "worker"],
        min_interval_s=args.min_interval,
    )
    config: dict[str, object] = {"trainer": {"batch_size": 64, "lr": 0.1}, "job": job_name}
    if args.leak_key:
        # What a careless user might put in a config: both must be redacted before W&B.
        key = os.environ.get("WANDB_API_KEY", "")
        config["logger"] = {"api_key": key}
        config["note"] = f"run with key {key}"
    info = RunInfo(output_dir=out, job_name=job_name, group="test-group", config=config)
    tracker = make_tracker(cfg, env, info)
    failed = True
    try:
        for step in range(1, args.steps + 1):
            tracker.log(step, fake_stats(step, env.rank))
        tracker.log_eval(args.steps, {"val/acc": 0.5, "val/loss": 0.7})
        tracker.summary({"test/acc": 0.9})
        failed = fail
    finally:
        tracker.close(failed=failed)


def main() -> int:
    """Parse arguments, join the process group if launched with several ranks, run."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--backend", default="wandb")
    parser.add_argument("--layout", default="gather")
    parser.add_argument("--mode", default="offline")
    parser.add_argument("--steps", type=int, default=5)
    # 0 (every row to W&B) unless a test checks the rate limit: the tests check every row.
    parser.add_argument("--min-interval", type=float, default=0.0)
    parser.add_argument("--scenario", choices=["train", "sequential"], default="train")
    parser.add_argument("--leak-key", action="store_true")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    if world > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=60)
        )
    env = DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        device=device,
    )
    code = 0
    try:
        if args.scenario == "train":
            run_job(args, env, args.out, "train", fail=False)
        else:
            # A Hydra multirun with the basic launcher: jobs run one after another in this
            # process; the second one fails.
            for i in range(2):
                run_job(args, env, args.out / f"job{i}", f"job{i}", fail=i == 1)
    except UserError as e:
        # One write() per line: both ranks share torchrun's stderr pipe, and print() writes the
        # text and the newline separately, so two ranks' lines could interleave mid-line.
        os.write(sys.stderr.fileno(), f"error: {e}\n".encode())
        (args.out / f"exit-rank{rank}.txt").write_text(f"2\n{e}\n", encoding="utf-8")
        code = 2
        if world > 1:
            # Only so torchrun cannot stop the other rank before it has written its marker.
            dist.barrier()
    finally:
        (args.out / f"result-rank{rank}.json").write_text(
            json.dumps({"wandb_imported": "wandb" in sys.modules}), encoding="utf-8"
        )
        if dist.is_initialized():
            dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
