"""One job of a Ray sweep: the Ray task (`run_job`), which runs the job in a process of its
own (_job.py).

That process has its own session: Ray reuses its worker processes from task to task, and a job
changes process-wide state (signal handlers of torch's elastic agent, OpenMP threads, caches of
the resolved job dir). By default it is forked from a warm parent that imported torch, Hydra
and the template once (_warm.py), so a job starts in well under a second instead of paying the
imports; `hydra.launcher.warm_start=false` starts a fresh interpreter per job instead. A stop
(Ray's cancel of the task, on Ctrl-C / SIGTERM of the sweep) becomes SIGTERM to the job, which
then saves a checkpoint and stops, as under SIGTERM from a scheduler.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hydra_plugins.hydra_ddp_ray_launcher import _job

# Set in a job's process: the number of the job in its Ray sweep (train.py records a stop as
# a preemption, so the report lists it).
JOB_ENV = "HYDRA_DDP_RAY_JOB"  # hydra_ddp.distributed.entry.RAY_JOB_ENV
# Set in a job's process: when its task started that process (time.time()).
STARTED_ENV = "HYDRA_DDP_JOB_STARTED"  # hydra_ddp.rundir.sweeps.STARTED_ENV
# How often a task looks at its job and at the sweep's stop request.
_POLL_S = 0.5
# What a task returns when the sweep stopped before its job started.
NOT_STARTED = "not started: the sweep was stopped"


def run_job(
    spec: bytes, env: dict[str, str], cwd: str, grace_s: float, stop_file: str, warm: bool = True
) -> Any:
    """The Ray task: run one job in its own process; return its pickled JobReturn, or why there
    is none.

    The sweep asks its jobs to stop by creating `stop_file` (in the sweep dir, which every node
    sees): ray.cancel did not interrupt a running task (Ray 2.60), and a task that waits on a Ray
    call gives its CPUs back to Ray meanwhile, so a job that asked a Ray actor would let more
    jobs start than the machine holds."""
    import ray

    if os.path.exists(stop_file):
        return NOT_STARTED
    job_env = dict(os.environ, **env)
    gpus = ray.get_gpu_ids()
    if gpus:  # what Ray assigned: the job sees these GPUs only
        job_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    with tempfile.TemporaryDirectory(prefix="hydra_ddp_ray_") as tmp:
        spec_path, result_path = Path(tmp) / "spec.pkl", Path(tmp) / "return.pkl"
        spec_path.write_bytes(spec)
        # When the job's process started, for the sweep's journal (a job's start-up is what
        # warm starts save: bench_sweep.py reads it).
        job_env[STARTED_ENV] = repr(time.time())
        if warm:
            proc = _warm_parent(job_env).start(str(spec_path), str(result_path), job_env, cwd)
        else:
            cmd = [sys.executable, "-m", _job.__name__, str(spec_path), str(result_path)]
            # Its own session: its ranks are in its process group, which `_end` clears.
            proc = subprocess.Popen(cmd, env=job_env, cwd=cwd, start_new_session=True)
        try:
            while proc.poll() is None:
                time.sleep(_POLL_S)
                if os.path.exists(stop_file):
                    _stop(proc, grace_s)
        except KeyboardInterrupt:  # ray.cancel, where it reaches a running task
            _stop(proc, grace_s)
            raise
        finally:
            _end(proc)
        if result_path.is_file():
            return result_path.read_bytes()
        return f"the job's process exited with status {proc.returncode} and no result"


# This Ray worker's warm parents, one per OpenMP thread count (fixed when a library loads).
_warm: dict[str, Any] = {}


def _warm_parent(job_env: dict[str, str]) -> Any:
    """The warm parent for this job's thread count: kept for the next job on this worker,
    replaced when it died or the template's code changed since it imported it."""
    from hydra_plugins.hydra_ddp_ray_launcher._warm import Warm

    threads = job_env.get("OMP_NUM_THREADS", "")
    parent = _warm.get(threads)
    if parent is None or not parent.usable():
        if parent is not None:
            parent.close()
        # It imports under the worker's own environment and the job's thread count; each
        # child then takes its job's whole environment (CUDA_VISIBLE_DEVICES among it).
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        env["OMP_NUM_THREADS"] = threads or env.get("OMP_NUM_THREADS", "1")
        parent = _warm[threads] = Warm(env)
    return parent


def _stop(proc: Any, grace_s: float) -> None:
    """SIGTERM to the job (its launcher passes it to its ranks, which save a checkpoint), then
    SIGKILL to whatever of it is left after `grace_s`."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass


def _end(proc: Any) -> None:
    """Leave no process of the job behind (a rank its launcher lost track of)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
