"""Stand-in training jobs for tests/test_tracking.py: functions run on the gloo ranks of
helpers/ranks.py (or on one process), each building a tracker as the training loop does.

They log synthetic stats in which rank 1 is the straggler (slower steps, less data wait), so the
tests can check the cross-rank aggregates. This module imports nothing of W&B itself: with
logger=none (no logger.sink) nothing may import it (checked in a fresh process).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from hydra_ddp.config import Layout, LoggerConfig, WandbMode
from hydra_ddp.distributed import DistEnv
from hydra_ddp.tracking import RunInfo, Tracker

STEPS = 5
# What conf/logger/<name>.yaml sets logger.sink to.
LOGGER_SINKS = {"wandb": {"_target_": "hydra_ddp.tracking.wandb_sink.WandbSink"}, "none": None}


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


def run_job(
    env: DistEnv,
    out: Path,
    job_name: str = "train",
    *,
    logger: str = "wandb",
    layout: str = "gather",
    mode: str = "offline",
    steps: int = STEPS,
    min_interval: float = 0.0,  # every row to W&B unless a test checks the rate limit
    leak_key: Optional[str] = None,
    fail: bool = False,
) -> dict[str, bool]:
    """One job on this rank: build a tracker, log `steps` intervals, evaluate, close (as failed
    with fail=True). Returns whether W&B was imported in this process."""
    cfg = LoggerConfig(
        sink=LOGGER_SINKS[logger],
        layout=Layout(layout),
        mode=WandbMode(mode),
        project="hydra-ddp-tests",
        tags=["test", "worker"],
        min_interval_s=min_interval,
    )
    config: dict[str, object] = {"trainer": {"batch_size": 64, "lr": 0.1}, "job": job_name}
    if leak_key:
        # What a careless user might put in a config: both must be redacted before W&B.
        config["logger"] = {"api_key": leak_key}
        config["note"] = f"run with key {leak_key}"
    info = RunInfo(output_dir=Path(out), job_name=job_name, group="test-group", config=config)
    tracker = Tracker(cfg, env, info)
    failed = True
    try:
        for step in range(1, steps + 1):
            tracker.log(step, fake_stats(step, env.rank))
        tracker.log_eval(steps, {"val/acc": 0.5, "val/loss": 0.7})
        tracker.summary({"test/acc": 0.9})
        failed = fail
    finally:
        tracker.close(failed=failed)
    return {"wandb_imported": "wandb" in sys.modules}


def sequential(env: DistEnv, out: Path, steps: int = STEPS) -> None:
    """A Hydra multirun with the basic launcher: jobs run one after another in one process
    (no process group); the second one fails."""
    for i in range(2):
        run_job(DistEnv(), Path(out) / f"job{i}", f"job{i}", steps=steps, fail=i == 1)


def resume_attempt(
    env: DistEnv, out: Path, name: str, first: int, last: int, resumed: Optional[int]
) -> None:
    """One attempt of a one-process job (layout gather) logging steps first..last, resumed
    from a checkpoint at step `resumed` (None: started from step 0)."""
    cfg = LoggerConfig(
        sink=LOGGER_SINKS["wandb"],
        layout=Layout.gather,
        mode=WandbMode.offline,
        project="hydra-ddp-tests",
        min_interval_s=0,
    )
    info = RunInfo(output_dir=Path(out), job_name=name, group="test-group", config={"job": name})
    tracker = Tracker(cfg, DistEnv(), info, resumed_step=resumed)
    for step in range(first, last + 1):
        tracker.log(step, {"loss": 1.0 / step})
    tracker.log_eval(last, {"val/acc": 0.5})
    tracker.close()
