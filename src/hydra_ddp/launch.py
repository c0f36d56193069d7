"""Starting workers, and reporting on sweeps of DDP jobs.

`spawn` is `python -m hydra_ddp.train dist.nproc_per_node=N`: the Hydra job that composed and
validated the config starts N workers with torch's elastic agent (the machinery behind
torchrun) and hands each the finished config object, so workers never re-compose, re-sweep or
re-resolve `${now:}`. `SweepReport` is a Hydra callback that lists, at the end of a multirun,
which jobs failed and where their logs are.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Callable

from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from hydra_ddp.config import TrainConfig
from hydra_ddp.dist import env_from_environ, launcher_rank
from hydra_ddp.errors import UserError

log = logging.getLogger(__name__)

_LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
_sweep_failed = False
_NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


TrainFn = Callable[..., dict[str, Any]]


def spawn(train: TrainFn, cfg: TrainConfig, run: Any) -> dict[str, Any]:
    """Run `train(cfg, env, run)` on `cfg.dist.nproc_per_node` local workers; return rank 0's
    summary. `train` is passed in (pickled by reference) so this module needs no import of the
    loop."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if "OMP_NUM_THREADS" not in os.environ:
        # What torchrun does too: N workers each running a full-size OpenMP pool on the same
        # cores spend their time fighting over them (10x slower on a 2-core CPU job).
        os.environ["OMP_NUM_THREADS"] = "1"
    errors = Path(run.output_dir) / "errors"
    for old in errors.glob("rank*.txt"):
        old.unlink()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.dist.nproc_per_node,
        run_id=f"hydra-ddp-{uuid.uuid4().hex[:12]}",
        # c10d rendezvous on a free local port, as `torchrun --standalone` does.
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=cfg.dist.max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
    )
    log.info(
        "starting %d workers (max_restarts=%d); logs: %s",
        cfg.dist.nproc_per_node,
        cfg.dist.max_restarts,
        Path(run.output_dir) / "train_rank*.log",
    )
    # The workers' process group gets a fresh store from worker rank 0 at every attempt instead
    # of the agent's store, which outlives restarts: on that one a restarted rank can read the
    # previous attempt's addresses and hang (pytorch/pytorch#135712, still so in torch 2.13).
    # The job dir is decided here already, so nothing needs the agent's store.
    saved = os.environ.get(_NO_SHARED_STORE)
    os.environ[_NO_SHARED_STORE] = "1"
    # The agent logs a failed worker with a traceback of its own polling code: noise next to
    # the worker's own error (already in its log, and reported below).
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    agent_log.addFilter(_drop_traceback)
    try:
        results = elastic_launch(config, worker)(train, cfg, run)
    except ChildFailedError as e:
        # Name the lowest rank that said why it stopped (the agent may record only the rank
        # that exited first, or a rank it terminated itself); else the lowest failed rank.
        said = sorted(
            int(p.stem[len("rank") :])
            for p in errors.glob("rank*.txt")
            if p.stem[len("rank") :].isdigit()
        )
        rank = said[0] if said else min(e.failures)
        failure = e.failures.get(rank)
        why = _first_error(errors, rank) or (
            f"exit code {failure.exitcode}" if failure else "it stopped"
        )
        raise UserError(
            f"worker rank {rank} failed: {why} (log: "
            f"{Path(run.output_dir) / f'train_rank{rank}.log'})"
        ) from None
    finally:
        agent_log.removeFilter(_drop_traceback)
        if saved is None:
            os.environ.pop(_NO_SHARED_STORE, None)
        else:
            os.environ[_NO_SHARED_STORE] = saved
    return results[0]


def _drop_traceback(record: logging.LogRecord) -> bool:
    record.exc_info, record.exc_text = None, None
    return True


def _first_error(errors: Path, rank: int) -> str | None:
    path = errors / f"rank{rank}.txt"
    return path.read_text().strip() if path.is_file() else None


def worker(train: TrainFn, cfg: TrainConfig, run: Any) -> dict[str, Any]:
    """One worker started by `spawn`: log setup, then the same `train` torchrun ranks run."""
    rank = int(os.environ.get("RANK", 0))
    _setup_worker_logging(Path(run.output_dir), rank)
    try:
        return train(cfg, env_from_environ(cfg.dist), run)
    except UserError as e:
        log.error("error: %s", e)
        errors = Path(run.output_dir) / "errors"
        errors.mkdir(exist_ok=True)
        (errors / f"rank{rank}.txt").write_text(str(e) + "\n")
        # A clean exit code rather than a traceback from every worker.
        sys.exit(2)
    except Exception:
        log.exception("rank %d failed", rank)
        raise


def _setup_worker_logging(output_dir: Path, rank: int) -> None:
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    console = logging.StreamHandler(sys.stderr)
    # Only rank 0 talks on the console; every rank keeps its full log in its own file.
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    file = logging.FileHandler(output_dir / f"train_rank{rank}.log")
    for handler in (console, file):
        handler.setFormatter(logging.Formatter(_LOG_FORMAT))
        root.addHandler(handler)


# --------------------------------------------------------------------------------------------
# Sweeps
# --------------------------------------------------------------------------------------------


def record_failure(output_dir: Path, message: str) -> None:
    """Mark a job of a sweep as failed, for SweepReport to find."""
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    (Path(output_dir) / "failure.json").write_text(json.dumps({"error": message}) + "\n")


def sweep_failed() -> bool:
    """True when the sweep that just ran in this process had a failing job."""
    return _sweep_failed


class SweepReport(Callback):
    """At the end of a multirun, list every job with its status, objective and log, and write
    the list to <sweep dir>/sweep_report.json. It reads the job directories, so it works for
    launchers that run jobs in other processes (submitit) as well as in this one.

    Each job's rank 0 leaves what Hydra got back from the job (the objective a sweeper such as
    Optuna's optimises) in <job dir>/job_return.json; the report shows it as `objective`."""

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        # A sweep rerun into the same sweep dir must not report the previous run's outcome.
        if _is_multirun(config) and launcher_rank() == 0:
            output_dir = Path(config.hydra.runtime.output_dir)
            for name in ("failure.json", _JOB_RETURN):
                (output_dir / name).unlink(missing_ok=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global _sweep_failed
        # Absolute, so the paths in the report and on the console work from anywhere.
        sweep_dir = Path(config.hydra.sweep.dir).absolute()
        jobs = []
        job_dirs = [p for p in sweep_dir.iterdir() if (p / ".hydra").is_dir()]
        for job_dir in sorted(job_dirs, key=_job_order):
            failure, summary = job_dir / "failure.json", job_dir / "summary.json"
            returned = _read_json(job_dir / _JOB_RETURN) or {}
            objective = returned.get("return_value")
            if failure.is_file():
                status, detail = "FAILED", json.loads(failure.read_text())["error"]
            elif summary.is_file():
                status, detail = "ok", json.loads(summary.read_text()).get("objective")
            else:
                status, detail = "FAILED", "no summary.json (the job died)"
            logs = sorted(str(p) for p in job_dir.glob("*.log"))
            jobs.append(
                {
                    "job": job_dir.name,
                    "status": status,
                    "objective": objective,
                    "detail": detail,
                    "dir": str(job_dir),
                    "logs": logs,
                }
            )
        (sweep_dir / "sweep_report.json").write_text(json.dumps(jobs, indent=2) + "\n")
        failed = [j for j in jobs if j["status"] != "ok"]
        _sweep_failed = bool(failed)
        log.info(
            "sweep done: %d job(s), %d failed; report: %s",
            len(jobs),
            len(failed),
            sweep_dir / "sweep_report.json",
        )
        for j in jobs:
            line = f"  {j['status']:6s} {j['job']}: {j['detail']}"
            if j["status"] != "ok":
                line += f" (logs: {', '.join(j['logs']) or j['job']})"
            (log.error if j["status"] != "ok" else log.info)(line)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        if job_return.hydra_cfg is None or launcher_rank() != 0:
            return  # under submitit every task of a job gets here: rank 0 speaks for the job
        output_dir = Path(job_return.hydra_cfg.hydra.runtime.output_dir)
        if job_return.status == JobStatus.FAILED:
            # A job that raised past train.py's own handling (a bug) still gets marked.
            record_failure(output_dir, repr(job_return._return_value))
        if _is_multirun(job_return.hydra_cfg):
            value = job_return._return_value if job_return.status == JobStatus.COMPLETED else None
            number = float(value) if isinstance(value, (int, float)) else None
            (output_dir / _JOB_RETURN).write_text(
                json.dumps(
                    {
                        "status": job_return.status.name,
                        "return_type": type(value).__name__,
                        # JSON has no NaN: a failed job's NaN objective is written as null.
                        "return_value": number
                        if number is not None and math.isfinite(number)
                        else None,
                    }
                )
                + "\n"
            )


_JOB_RETURN = "job_return.json"


def _is_multirun(config: DictConfig) -> bool:
    from hydra.types import RunMode

    return OmegaConf.select(config, "hydra.mode") == RunMode.MULTIRUN


def _job_order(job_dir: Path) -> tuple[int, str]:
    """Jobs in launch order: `10_...` after `9_...` (the subdir starts with the job number)."""
    head = job_dir.name.split("_", 1)[0]
    return (int(head) if head.isdigit() else sys.maxsize, job_dir.name)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
