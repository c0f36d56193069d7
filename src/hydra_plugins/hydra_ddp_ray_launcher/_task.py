"""One job of a Ray sweep: the Ray task (`run_job`), which runs the job in a process of its
own (_job.py).

That process has its own session: Ray reuses its worker processes from task to task, and a job
changes process-wide state (signal handlers of torch's elastic agent, OpenMP threads, caches of
the resolved job dir). By default it is forked from its node's warm server, which imported
torch, Hydra and the template once (_warm.py), so a job starts in well under a second instead
of paying the imports; `hydra.launcher.warm_start=false` starts a fresh interpreter per job. A stop
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
JOB_ENV = "HYDRA_DDP_RAY_JOB"  # hydra_ddp.launch.runner.RAY_JOB_ENV
# Set in a job's process: when its task started that process (time.time()).
STARTED_ENV = "HYDRA_DDP_JOB_STARTED"  # hydra_ddp.rundir.sweeps.STARTED_ENV
# How often a task looks at its job and at the sweep's stop request.
_POLL_S = 0.5
# How long a job waits for its node's warm server while that still imports (its first sweep).
_WARM_WAIT_S = 120.0
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
        request = {"spec": str(spec_path), "result": str(result_path), "env": job_env, "cwd": cwd}
        proc = _warm_start(request) if warm else None
        if proc is None:
            cmd = [sys.executable, "-m", _job.__name__, str(spec_path), str(result_path)]
            # Its own session: its ranks are in its process group, which `_end` clears.
            proc = subprocess.Popen(cmd, env=job_env, cwd=cwd, start_new_session=True)
        try:
            while not _ended(proc, _POLL_S):
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


def started() -> None:
    """An empty task: its worker process, once started, runs the sweep's jobs next
    (Session.start_workers)."""


def _warm_start(request: dict[str, Any]) -> Any:
    """The job forked from this node's warm server (for its thread count), waiting for one
    that is still importing; None when there is none (the sweep made its keeper: _sweep.py)."""
    import ray

    from hydra_plugins.hydra_ddp_ray_launcher import _warm

    threads = int(request["env"].get("OMP_NUM_THREADS", "1"))
    path = _warm.socket_path(ray.get_runtime_context().get_node_id(), threads)
    child = _warm.start(path, request, _WARM_WAIT_S) if path else None
    if child is None:
        print("no warm server on this node: the job starts a fresh interpreter", file=sys.stderr)
    return child


def _ended(proc: Any, timeout: float) -> bool:
    """Whether the job ended, waiting up to `timeout` seconds for it (its end wakes this at
    once, so the next job starts without waiting out a poll)."""
    try:
        proc.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


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
