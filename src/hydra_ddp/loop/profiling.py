"""`trainer.profile_steps`: torch.profiler over a window of training steps, on every rank.

Each rank writes `<output dir>/profile/rank<r>.pt.trace.json` (Chrome trace format: open it in
https://ui.perfetto.dev, chrome://tracing, or TensorBoard's profiler plugin pointed at the
folder) and logs the ops that took the most time, so a slow rank can be compared with the
others without opening anything.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

from torch.profiler import ProfilerActivity, profile, schedule

from hydra_ddp.config import TrainerConfig
from hydra_ddp.distributed import DistEnv

log = logging.getLogger(__name__)

_TOP_OPS = 15


def step_profiler(tcfg: TrainerConfig, env: DistEnv, output_dir: Path) -> Any:
    """A profiler to `.step()` after every training step, or a no-op when profiling is off."""
    if tcfg.profile_steps <= 0:
        return contextlib.nullcontext(_NoProfiler())
    activities = [ProfilerActivity.CPU]
    if env.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    folder = Path(output_dir) / "profile"
    sort_by = "self_cuda_time_total" if env.device.type == "cuda" else "self_cpu_time_total"

    def ready(prof: profile) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{env.rank}.pt.trace.json"
        prof.export_chrome_trace(str(path))
        log.info(
            "profile of steps %d-%d on rank %d (trace: %s; open in ui.perfetto.dev):\n%s",
            tcfg.profile_start + 1,
            tcfg.profile_start + tcfg.profile_steps,
            env.rank,
            path,
            prof.key_averages().table(sort_by=sort_by, row_limit=_TOP_OPS),
        )

    return profile(
        activities=activities,
        # One warm-up step inside the skipped ones: the profiler's own start-up stays out of
        # the recorded window.
        schedule=schedule(
            skip_first=max(tcfg.profile_start - 1, 0),
            wait=0,
            warmup=1 if tcfg.profile_start > 0 else 0,
            active=tcfg.profile_steps,
            repeat=1,
        ),
        on_trace_ready=ready,
    )


class _NoProfiler:
    def step(self) -> None:
        pass
