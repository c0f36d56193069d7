"""One job of a Ray sweep: the Ray task (`run_job`) and the job's own process (`main`).

The task starts the job in a fresh process of its own session, as `python -m hydra_ddp.train`
would run it: Ray reuses its worker processes from task to task, and a job changes process-wide
state (signal handlers of torch's elastic agent, OpenMP threads, caches of the resolved job
dir). A stop (Ray's cancel of the task, on Ctrl-C / SIGTERM of the sweep) becomes SIGTERM to
the job, which then saves a checkpoint and stops, as under SIGTERM from a scheduler.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# Set in a job's process: the number of the job in its Ray sweep (train.py records a stop as
# a preemption, so the report lists it).
JOB_ENV = "HYDRA_DDP_RAY_JOB"  # hydra_ddp.train.RAY_JOB_ENV
# How often a task looks at its job and at the sweep's stop request.
_POLL_S = 0.5
# What a task returns when the sweep stopped before its job started.
NOT_STARTED = "not started: the sweep was stopped"


def run_job(spec: bytes, env: dict[str, str], cwd: str, grace_s: float, stop_file: str) -> Any:
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
        cmd = [sys.executable, "-m", __name__, str(spec_path), str(result_path)]
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


def _stop(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the job (its launcher passes it to its ranks, which save a checkpoint), then
    SIGKILL to whatever of it is left after `grace_s`."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass


def _end(proc: subprocess.Popen) -> None:
    """Leave no process of the job behind (a rank its launcher lost track of)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def main(spec_path: str, result_path: str) -> int:
    """The job's process: run the job as Hydra's launchers do, write what it returned."""
    import cloudpickle
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.singleton import Singleton
    from hydra.core.utils import run_job as hydra_run_job
    from hydra.core.utils import setup_globals

    # The template's resolvers (job dir names, log files) and config schema, registered at its
    # import: the job's config names them.
    import hydra_ddp.train  # noqa: F401
    from hydra_ddp.dist import claim

    # Ray starts its workers with SIGINT blocked, and a blocked mask is inherited: a job's
    # ranks must see Ctrl-C like any job's (preemption.py).
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _stop_with_parent()
    spec = cloudpickle.loads(Path(spec_path).read_bytes())
    setup_globals()
    Singleton.set_state(spec["singleton_state"])
    HydraConfig.instance().set_config(spec["config"])
    try:
        returned = hydra_run_job(
            hydra_context=spec["hydra_context"],
            task_function=spec["task_function"],
            config=spec["config"],
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
        )
    finally:
        claim.release_all()
    Path(result_path).write_bytes(cloudpickle.dumps(returned))
    return 0


def _stop_with_parent() -> None:
    """SIGTERM to this job when the Ray worker that started it dies (Ray stopped, the node
    lost): the job saves a checkpoint and stops instead of training on unsupervised."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="stop-with-parent").start()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
