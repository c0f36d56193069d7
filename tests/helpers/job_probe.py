"""A callback that writes what a job's process looks like at its start, then leaves state
behind (a module global, Python's and torch's seeds, an environment variable, a signal
handler), for tests/test_ray_isolation.py: the next job of the sweep must see none of it."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

import torch

# Set by the first job that runs in a process; a later job must find it unset.
LEFT_BEHIND = None


class Probe:
    def on_train_start(self, ctx) -> None:
        global LEFT_BEHIND
        seen = {
            "left_behind": LEFT_BEHIND,
            "env_left_behind": os.environ.get("HYDRA_DDP_PROBE_LEFT"),
            "sigusr2": str(signal.getsignal(signal.SIGUSR2)),
            "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
            "random": random.random(),
            "torch_seed_initial": torch.initial_seed(),
            "default_dtype": str(torch.get_default_dtype()),
            "modules_from_other_jobs": sorted(m for m in sys.modules if m.startswith("user_")),
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "sid_is_own": os.getsid(0) == os.getpid(),
            "cwd": os.getcwd(),
            "sys_path0": sys.path[0],
            "threads": torch.get_num_threads(),
            "omp": os.environ.get("OMP_NUM_THREADS"),
            "job": os.environ.get("HYDRA_DDP_RAY_JOB"),
            "ray_worker_env": sorted(
                k for k in os.environ if k in ("RAY_RAYLET_PID", "RAY_JOB_ID")
            ),
            "breakpoint": os.environ.get("PYTHONBREAKPOINT"),
            "time": time.time(),
            "cmdline": _cmdline(os.getpid()),
            "parent_cmdline": _cmdline(os.getppid()),
        }
        (ctx.output_dir / "probe.json").write_text(json.dumps(seen))
        LEFT_BEHIND = ctx.output_dir.name
        os.environ["HYDRA_DDP_PROBE_LEFT"] = ctx.output_dir.name
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        random.seed(1234)
        torch.manual_seed(1234)


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()
