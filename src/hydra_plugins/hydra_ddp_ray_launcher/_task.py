"""One job of a Ray sweep: the Ray task (`run`) starts the job as a fresh interpreter
(`job_process`) and watches it. Not in the Ray worker itself, which Ray reuses: a job's
process-wide state (import side effects, signal handlers, seeds) must not reach the next. The
config (secrets included) goes through a pipe and the result comes back through another, so
nothing is written outside the job's dir. A stop of the sweep is SIGTERM to the job.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from hydra_ddp.launcher_env import JOB_STARTED_ENV

# Ray's own workers' variables; a job's process is not one (its `breakpoint()` would call Ray's).
_RAY_WORKER_ENV = ("RAY_JOB_ID", "RAY_RAYLET_PID", "RAY_CLIENT_MODE", "RAY_LD_PRELOAD_ON_WORKERS")
# How often a task, and the sweep's wait for its jobs, look at a stop request.
POLL_S = 0.5
# What a task returns when the sweep stopped before its job started.
NOT_STARTED = "not started: the sweep was stopped"


def run(spec: bytes, env: dict[str, str], cwd: str, grace_s: float, stop_file: str) -> Any:
    """The Ray task: one job in a fresh process; its pickled JobReturn, or why there is none.

    A stop is asked by creating `stop_file` (in the sweep dir, seen by every node): Ray's cancel
    does not interrupt a running task, and waiting on a Ray call would give its CPUs back.
    CUDA_VISIBLE_DEVICES: Ray sets it to the task's GPUs, and the job inherits it."""
    if os.path.exists(stop_file):
        return NOT_STARTED
    job_env = {k: v for k, v in os.environ.items() if k not in _RAY_WORKER_ENV}
    if job_env.get("PYTHONBREAKPOINT", "").startswith("ray."):
        del job_env["PYTHONBREAKPOINT"]
    job_env.update(env)
    job_env[JOB_STARTED_ENV] = repr(time.time())
    result_read, result_write = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(result_write)],
            stdin=subprocess.PIPE,
            env=job_env,
            cwd=cwd,
            start_new_session=True,  # its ranks join its process group, which `_end` clears
            pass_fds=(result_write,),
        )
    finally:
        os.close(result_write)
    result: list[bytes] = []
    pipes = threading.Thread(target=_exchange, args=(proc, spec, result_read, result), daemon=True)
    pipes.start()
    ended = threading.Event()
    threading.Thread(target=lambda: (proc.wait(), ended.set()), daemon=True).start()
    try:
        while not ended.wait(POLL_S):
            if os.path.exists(stop_file):
                _stop(proc, grace_s)
    except KeyboardInterrupt:  # Ray's cancel, where it reaches a running task
        _stop(proc, grace_s)
        raise
    finally:
        _end(proc)
    pipes.join(timeout=30.0)
    if result and result[0]:
        return result[0]
    return f"the job's process exited with status {proc.returncode} and no result"


def _exchange(proc: subprocess.Popen, spec: bytes, result_read: int, result: list[bytes]) -> None:
    """The spec in, then the result out: in a thread, since either may wait on the other side."""
    with contextlib.suppress(OSError):  # it ended before it read: it leaves no result
        proc.stdin.write(spec)
        proc.stdin.close()
    with open(result_read, "rb") as f:
        result.append(f.read())


def _stop(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the job (its ranks save a checkpoint); `_end` kills what is left."""
    proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def job_process(result_fd: int) -> int:
    """The job's process: run the job as Hydra's launchers do; its return to `result_fd`."""
    # A Ray worker blocks SIGINT, and a mask survives exec: a job's ranks must see Ctrl-C.
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    spec = sys.stdin.buffer.read()
    with open(os.devnull, "rb") as devnull:
        os.dup2(devnull.fileno(), sys.stdin.fileno())
    _stop_with_parent()

    import cloudpickle
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.singleton import Singleton
    from hydra.core.utils import run_job, setup_globals

    # Registers the resolvers and config schema the job's config names.
    import hydra_ddp.launch.command  # noqa: F401
    from hydra_ddp.rundir import claim

    spec = cloudpickle.loads(spec)
    setup_globals()
    Singleton.set_state(spec["singleton_state"])
    HydraConfig.instance().set_config(spec["config"])
    try:
        returned = run_job(
            hydra_context=spec["hydra_context"],
            task_function=spec["task_function"],
            config=spec["config"],
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
        )
    finally:
        claim.release_all()
    with open(result_fd, "wb") as f:
        f.write(cloudpickle.dumps(returned))
    # As command.py: skip the last garbage collections of every object torch made.
    gc.freeze()
    return 0


def _stop_with_parent() -> None:
    """SIGTERM to this job when its Ray worker dies: it saves and stops, not trains on alone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="stop-with-parent").start()


if __name__ == "__main__":
    sys.exit(job_process(int(sys.argv[1])))
