"""The sweep's side of `hydra/launcher=ray`: start (or join) Ray, check that every job fits a
node, hand each job to Ray as a task (_task.py) asking for its CPUs and GPUs, collect what the
jobs return, and stop them all on a stop signal.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import cloudpickle
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from omegaconf import DictConfig, OmegaConf, open_dict

from hydra_ddp.errors import UserError, too_big_for_cluster
from hydra_ddp.launcher_env import RAY_JOB_ENV, STOP_SIGNALS
from hydra_ddp.rundir import sweeps
from hydra_plugins.hydra_ddp_ray_launcher import _task

log = logging.getLogger(__name__)


@dataclass
class RayJob:
    num: int
    overrides: list[str]
    config: DictConfig  # the job's own config (Hydra's sweep config)
    nproc: int  # its ranks (dist.nproc_per_node)
    cpus: float
    gpus: float
    threads: int  # OMP_NUM_THREADS of each of its ranks
    ref: Any = None  # Ray's handle on the running task


def launch(launcher: Any, job_overrides: Sequence[Sequence[str]], first: int) -> list[JobReturn]:
    """Run one batch of jobs (a basic sweep's all, Optuna's `n_jobs` trials) on Ray; their
    results in order."""
    import ray

    setup_globals()
    config = launcher.config
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    # Resolved here once: `${now:}` must name the same dir in every job's process.
    sweep_dir = str(config.hydra.sweep.dir)
    Path(sweep_dir).mkdir(parents=True, exist_ok=True)
    # Created on a stop request; every job's task looks for it (_task.run).
    launcher.stop_file = os.path.abspath(os.path.join(sweep_dir, ".stop_requested"))
    Path(launcher.stop_file).unlink(missing_ok=True)  # a previous sweep's, in a reused dir
    log.info("Ray: %d job(s) on %s; sweep dir: %s", len(job_overrides), launcher.where, sweep_dir)
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    jobs: list[RayJob] = []
    returns: dict[int, JobReturn] = {}
    stop = launcher.stop
    with stop.launching():
        # Composed and handed to Ray in turn: the first ones run while the later are composed.
        for i, overrides in enumerate(job_overrides):
            job = _job(launcher, list(overrides), first + i, sweep_dir)
            jobs.append(job)
            if stop.signum is not None:
                continue  # not handed out: `_stopped` records it as never started
            swept = " ".join(filter_overrides(job.overrides))
            try:
                fit_to_nodes([job], nodes, launcher.where)
            except UserError as e:  # Ray would queue it forever: it fails, the others run
                log.error("error: %s", e)
                returns[job.num] = _not_run(job, str(e))
                continue
            gpus = f", {job.gpus:g} GPU(s)" if job.gpus > 0 else ""
            resources = f"{job.cpus:g} CPU(s){gpus} ({job.threads} thread(s) per rank)"
            log.info("\t#%d : %s (%s)", job.num, swept, resources)
            job.ref = _submit(launcher, job)
        returns.update(_wait(launcher, [j for j in jobs if j.ref is not None]))
        if stop.signum is not None:
            _stopped(launcher, jobs, returns, stop.signum)
    return [returns[j.num] for j in jobs]


_IGNORED_KEYS = {
    "warm_start": "every job starts as a fresh interpreter",
    "warm_idle_s": "no process outlives the sweep",
}


def prepare(launcher: Any) -> None:
    """Take the stop signals for the sweep's whole life, then start or join Ray."""
    for line in ignored_keys(launcher.params):
        log.warning("%s", line)
    launcher.stop = StopRequests()
    _start_ray(launcher)
    # Ray's driver puts its own handler of SIGTERM (a crash report, then exit 1) in ours' place.
    launcher.stop.take_signals()


def ignored_keys(params: dict[str, Any]) -> list[str]:
    return [
        f"hydra.launcher.{key} is ignored ({why}): drop it"
        for key, why in _IGNORED_KEYS.items()
        if params.get(key) is not None
    ]


def _job(launcher: Any, overrides: list[str], num: int, sweep_dir: str) -> RayJob:
    config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, overrides)
    with open_dict(config):
        config.hydra.job.id = f"ray_{num}"
        config.hydra.job.num = num
        config.hydra.sweep.dir = sweep_dir
    return RayJob(num, overrides, config, *job_resources(config))


def job_resources(config: DictConfig) -> tuple[int, float, float, int]:
    """A job's ranks, its CPUs and GPUs for Ray, each rank's OpenMP threads (its share of the
    CPUs). GPUs -1: `gpus_per_job=null`, settled by `fit_to_nodes`."""
    nproc = int(OmegaConf.select(config, "dist.nproc_per_node", default=1) or 1)
    cpus = OmegaConf.select(config, "hydra.launcher.cpus_per_job", default=None)
    cpus = float(nproc if cpus is None else cpus)
    gpus = OmegaConf.select(config, "hydra.launcher.gpus_per_job", default=None)
    device = str(OmegaConf.select(config, "dist.device", default="auto"))
    if gpus is None:
        gpus = -1.0 if device.split(".")[-1] != "cpu" else 0.0
    threads = max(1, math.floor(cpus / nproc))
    return nproc, cpus, float(gpus), threads


def fit_to_nodes(jobs: list[RayJob], nodes: list[dict[str, float]], where: str) -> None:
    """Settle each job's GPUs (`null`: one per rank where the cluster has GPUs); a UserError for
    a job no node fits (Ray would queue it forever)."""
    most = {
        kind: max((float(r.get(kind, 0.0)) for r in nodes), default=0.0) for kind in ("CPU", "GPU")
    }
    for j in jobs:
        if j.gpus < 0:
            j.gpus = float(j.nproc) if most["GPU"] > 0 else 0.0
    for kind in ("GPU", "CPU"):
        need_of = (lambda j: j.gpus) if kind == "GPU" else (lambda j: j.cpus)
        job = max(jobs, key=need_of)
        if need_of(job) > most[kind]:
            raise too_big_for_cluster(kind, need_of(job), most[kind], job.num, job.nproc, where)


def _start_ray(launcher: Any) -> None:
    """Start a Ray for this sweep (stopped at its end), or join a cluster (left running)."""
    import ray

    params = launcher.params
    # No telemetry: a compute node without internet would wait on it.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray starts its workers at niceness 15, and a job would inherit it: on a shared
    # machine it would get a sliver of the cores. (A cluster: set it at `ray start`.)
    os.environ.setdefault("RAY_worker_niceness", "0")
    address = params.get("address")
    extra = dict(OmegaConf.to_container(params["init"]) if params.get("init") else {})
    # Each job logs to its own dir; interleaved lines of parallel jobs help no one.
    extra.setdefault("log_to_driver", False)
    if address:
        # A cluster token at hand (Ray's variables, or the file `ray start` writes).
        token = (Path.home() / ".ray" / "auth_token").is_file() or any(
            k in os.environ for k in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
        )
        if "RAY_AUTH_MODE" not in os.environ and token:
            # What `ray start` sets up by default, which ray.init(address=) does not assume.
            os.environ["RAY_AUTH_MODE"] = "token"
        ray.init(address=str(address), logging_level=logging.WARNING, **extra)
        launcher.where = f"the Ray cluster at {address}"
    else:
        # Ray's minimum: only small task arguments go through the object store.
        extra.setdefault("object_store_memory", 80 * 1024 * 1024)
        ray.init(
            # A new Ray, even where `ray start` runs one here (which ray.init() would join).
            address="local",
            num_cpus=params.get("num_cpus"),
            num_gpus=params.get("num_gpus"),
            include_dashboard=False,
            logging_level=logging.WARNING,
            **extra,
        )
        launcher.where = "a Ray started for this sweep"
    # Also on an error's exit: no Ray process outlives the sweep.
    atexit.register(_stop_ray)


def _stop_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()  # a joined cluster keeps running; only this driver goes


def _submit(launcher: Any, job: RayJob) -> Any:
    """Hand the job to Ray with what its process needs to run it as Hydra's launchers do."""
    import ray

    spec = cloudpickle.dumps(
        {
            "hydra_context": launcher.hydra_context,
            "config": job.config,
            "task_function": launcher.task_function,
            "singleton_state": Singleton.get_state(),
        }
    )
    env = {"OMP_NUM_THREADS": str(job.threads), RAY_JOB_ENV: str(job.num)}
    remote = ray.remote(_task.run).options(
        num_cpus=job.cpus,
        num_gpus=job.gpus,
        max_retries=0,  # a failed job is reported, not run again behind the user's back
        name=f"job{job.num}",
    )
    return remote.remote(spec, env, os.getcwd(), launcher.grace_s, launcher.stop_file)


def _wait(launcher: Any, jobs: list[RayJob]) -> dict[int, JobReturn]:
    """Each job's result as it ends; on a stop request, the running ones are asked to stop
    (they save a checkpoint) and the queued ones dropped."""
    import ray

    by_ref = {j.ref: j for j in jobs}
    returns: dict[int, JobReturn] = {}
    pending = list(by_ref)
    cancelled_at: float | None = None
    grace, stop = launcher.grace_s, launcher.stop
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=_task.POLL_S)
        for ref in done:
            job = by_ref[ref]
            returns[job.num] = _result(ref, job)
            log.info("job #%d ended (%d running or queued)", job.num, len(pending))
        if stop.signum is not None and cancelled_at is None:
            log.warning(
                "stopping the sweep on %s: %d job(s) save a checkpoint and stop",
                signal.Signals(stop.signum).name,
                len(pending),
            )
            Path(launcher.stop_file).touch()  # what each job's task looks for
            for ref in pending:
                ray.cancel(ref, force=False)  # drops the queued ones
            cancelled_at = time.monotonic()
        elif cancelled_at is not None and time.monotonic() - cancelled_at > grace + 15:
            for ref in pending:
                ray.cancel(ref, force=True)
                returns[by_ref[ref].num] = _no_result(by_ref[ref])
            break
    return returns


def _result(ref: Any, job: RayJob) -> JobReturn:
    import ray
    from ray.exceptions import RayError, TaskCancelledError

    try:
        returned = ray.get(ref)
        returned = cloudpickle.loads(returned) if isinstance(returned, bytes) else returned
    except TaskCancelledError:
        return _no_result(job)
    except RayError as e:
        why = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        log.error("job #%d: Ray could not run it: %s", job.num, why)
        return _no_result(job)
    if isinstance(returned, str):  # why the job gave no result
        if returned != _task.NOT_STARTED:
            log.error("job #%d: %s", job.num, returned)
        return _no_result(job)
    return returned


def _not_run(job: RayJob, why: str) -> JobReturn:
    """A job Ray cannot run anywhere: failed, with `why`, in the report."""
    job_dir = Path(str(job.config.hydra.sweep.dir)) / str(job.config.hydra.sweep.subdir)
    sweeps.record_failure(job_dir, why)
    sweeps.record_not_started(job.config, job_dir, job.overrides)  # its row, with its overrides
    return _no_result(job)


def _no_result(job: RayJob) -> JobReturn:
    """NaN to the sweeper, as for a failed job; the report finds out why from its dir."""
    ret = JobReturn(overrides=job.overrides, status=JobStatus.COMPLETED)
    ret.return_value = float("nan")
    return ret


def _stopped(launcher: Any, jobs: list[RayJob], returns: dict[int, JobReturn], signum: int) -> None:
    """After a stop request, every job over: record those that never started, write the
    report, stop Ray and end the sweep (a sweeper must not go on to its next batch)."""
    for job in jobs:
        job_dir = Path(str(job.config.hydra.sweep.dir)) / str(job.config.hydra.sweep.subdir)
        if not job_dir.exists():
            sweeps.record_not_started(job.config, job_dir, job.overrides)
        elif not (job_dir / "summary.json").exists() and not (job_dir / "failure.json").exists():
            sweeps.record_failure(job_dir, "stopped while starting: nothing to resume", "PREEMPTED")
        returns.setdefault(job.num, _no_result(job))
    Path(launcher.stop_file).unlink(missing_ok=True)
    launcher.hydra_context.callbacks.on_multirun_end(config=launcher.config)
    _stop_ray()
    log.warning(
        "sweep stopped on %s: re-run it with the same hydra.sweep.dir (%s) to resume each "
        "stopped job from its checkpoint",
        signal.Signals(signum).name,
        os.path.abspath(str(launcher.config.hydra.sweep.dir)),
    )
    sys.exit(128 + signum)


class StopRequests:
    """The sweep's stop signals: during a launch each becomes a request the wait loop acts on
    (the jobs run in their own sessions: a terminal's Ctrl-C does not reach them); outside one
    it ends the sweep at once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._active = False
        self.take_signals()

    def take_signals(self) -> None:
        for name in STOP_SIGNALS:
            signal.signal(getattr(signal, name), self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum
        if self._active:
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt  # the command's one line (launch/command.py)
        log.warning("sweep stopped on %s", signal.Signals(signum).name)
        raise SystemExit(128 + signum)

    @contextlib.contextmanager
    def launching(self) -> Iterator[None]:
        if self.signum is not None:  # one came as the last launch ended: stop now
            self._handle(self.signum, None)
        self._active = True
        try:
            yield
        finally:
            self._active = False
