"""The sweep report, a Hydra callback: a failed job's record, the sweep's journal, and at the
end of a multirun a table of every job (sweep_jobs.py), by seed group for a sweep over seeds
(seed_groups.py). Secret values (redact.py) are blanked in the report, its table and journal.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Any, Sequence

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from hydra_ddp import redact
from hydra_ddp.disk import before, check_regular, open_regular
from hydra_ddp.errors import UserError
from hydra_ddp.launcher_env import JOB_STARTED_ENV, STOP_SIGNALS, launcher_rank
from hydra_ddp.rundir import claim, jsonfile, seed_groups, sweep_jobs
from hydra_ddp.rundir.paths import SWEPT_KEYS_FILE, swept_keys

log = logging.getLogger(__name__)

_sweep_failed = False
# The sweep this process runs, from its start to its report: (the report callback, its config).
_running: tuple[SweepReport, DictConfig] | None = None

_REPORT = "sweep_report.json"
_OPTUNA_RESULTS = "optimization_results.yaml"
# Every file of the sweep dir a sweep opens (Hydra's and Optuna's too): a FIFO there would block
# the sweep for ever, holding its claim.
_SWEEP_FILES = (sweep_jobs.JOURNAL, SWEPT_KEYS_FILE, _REPORT, "multirun.yaml", _OPTUNA_RESULTS)


def record_failure(output_dir: Path, message: str, status: str = "FAILED") -> None:
    """Mark a job of a sweep as failed (or PREEMPTED: stopped on request) for the report; rank 0
    writes it (under submitit every task of the job gets here)."""
    if launcher_rank() != 0:
        return
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    record = {"error": message, **({"status": status} if status != "FAILED" else {})}
    jsonfile.write(Path(output_dir) / "failure.json", record, indent=None)


def record_not_started(config: DictConfig, job_dir: Path, overrides: list[str]) -> None:
    """Journal a job a stopped sweep never started (Ray's queue): PREEMPTED in the report."""
    record = {"dir": os.path.abspath(job_dir), "event": "not_started", "overrides": overrides}
    _journal(config, **record)


def report_stopped() -> None:
    """The report of a sweep a stop ended in its own process (the basic launcher's, submitit's)."""
    if _running is not None:
        callback, config = _running
        callback.on_multirun_end(config)


def _stop_on_signals() -> None:
    """A submitit sweep's process only waits for its jobs: a stop signal ends it with one line,
    the report and exit 128 + the signal, instead of killing it silently with its claim held.
    Its jobs are the scheduler's and run on."""

    def stop(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        log.warning(
            "sweep stopped on %s: its submitted jobs run on under submitit (SLURM: scancel)", name
        )
        raise SystemExit(128 + signum)

    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), stop)


def sweep_failed() -> bool:
    return _sweep_failed


class SweepReport(Callback):
    """At the end of a multirun, the report (docs/sweeps.md, "The report") in the log and in
    <sweep dir>/sweep_report.json. `seed_keys`: hydra.callbacks.sweep_report.seed_keys."""

    def __init__(self, seed_keys: Sequence[str] = ()) -> None:
        self.seed_keys = [str(k) for k in seed_keys]

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _sweep_failed
        _sweep_failed = False
        _check_sweeper_direction(config)
        sweep_dir = Path(config.hydra.sweep.dir)
        _check_sweep_files(sweep_dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        claim.claim_sweep(sweep_dir)
        # A rerun into the same dir starts the journal afresh, with its start time: job dirs
        # not written since are another run's. Not an Optuna sweep: it continues its study.
        journal = sweep_dir / sweep_jobs.JOURNAL
        optuna = "hydra_ddp_optuna" in str(OmegaConf.select(config, "hydra.sweeper._target_"))
        if not (optuna and sweep_jobs.read_journal(journal)[1] is not None):
            _set_aside_report(sweep_dir)
            start = {"event": "sweep_start", "time": round(time.time(), 3)}
            journal.write_text(json.dumps(start) + "\n")
        jsonfile.write(sweep_dir / SWEPT_KEYS_FILE, _swept_keys(config), indent=None)
        global _running
        _running = (self, config)
        if "submitit" in str(OmegaConf.select(config, "hydra.launcher._target_", default="")):
            _stop_on_signals()

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not _is_multirun(config) or launcher_rank() != 0:
            return
        output_dir = Path(config.hydra.runtime.output_dir)
        # A sweep rerun into the same sweep dir must not report the previous run's outcome.
        for name in ("failure.json", sweep_jobs.JOB_RETURN):
            (output_dir / name).unlink(missing_ok=True)
        started = os.environ.get(JOB_STARTED_ENV)
        _journal(
            config,
            event="start",
            overrides=redact.overrides(OmegaConf.to_container(config.hydra.overrides.task)),
            **({"process_start": float(started)} if started else {}),
        )

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if job_return.hydra_cfg is None or launcher_rank() != 0:
            return  # under submitit every task of a job gets here: rank 0 speaks for the job
        output_dir = Path(job_return.hydra_cfg.hydra.runtime.output_dir)
        if job_return.status == JobStatus.FAILED:
            record_failure(output_dir, repr(job_return._return_value))
        if _is_multirun(job_return.hydra_cfg):
            value = job_return._return_value if job_return.status == JobStatus.COMPLETED else None
            number = float(value) if isinstance(value, (int, float)) else None
            failure = sweep_jobs.read_side_file(output_dir / "failure.json")
            returned = {
                "status": failure.get("status", "FAILED") if failure else job_return.status.name,
                "return_type": type(value).__name__,
                # JSON has no NaN: a failed job's NaN objective is written as null.
                "return_value": jsonfile.finite_or_none(number),
            }
            jsonfile.write(output_dir / sweep_jobs.JOB_RETURN, returned, indent=None)
            # Not job_return's copy of the config: it lost the sweep dir's resolved `${now:}`.
            _journal(config, event="end", **returned)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global _running
        _running = None
        try:
            self._report(config)
        finally:
            claim.release_sweep()

    def _report(self, config: DictConfig) -> None:
        global _sweep_failed
        # Hydra turns an exception here into a warning: no report must not pass for success.
        _sweep_failed = True
        sweep_dir = Path(os.path.abspath(config.hydra.sweep.dir))
        monitor = str(OmegaConf.select(config, "trainer.monitor", default="val/loss"))
        mode = OmegaConf.select(config, "trainer.monitor_mode", default="min")
        mode = str(getattr(mode, "value", mode))
        keys = _swept_keys(config)
        jobs = sweep_jobs.collect(sweep_dir, keys, monitor, mode)
        seeds = [k for k in self.seed_keys if k in keys]
        monitors = sorted({j["monitor"] for j in jobs if sweep_jobs.scored(j)})
        if len(monitors) > 1:  # e.g. trainer.monitor swept: a loss against an accuracy
            for job in jobs:
                job["best"] = False
            report, more = jobs, []
            best = f"not ranked: the jobs monitor different metrics ({', '.join(monitors)})"
            monitor, mode = "trainer.monitor", "per job"
        elif seeds:
            report, best, more = seed_groups.summarise(jobs, seeds, monitor, mode)
        else:
            report, best, more = jobs, sweep_jobs.mark_best(jobs, mode), []
        jsonfile.write(sweep_dir / _REPORT, report)
        _sweep_failed = any(j["status"] not in sweep_jobs.FINE for j in jobs)
        log.info(
            "sweep done: %s; objective %s (%s): %s; report: %s",
            sweep_jobs.counts(jobs),
            monitor,
            mode,
            best,
            sweep_dir / _REPORT,
        )
        header, *lines = sweep_jobs.job_table(jobs, monitor, mode)
        log.info(header)
        for job, line in zip(jobs, lines):
            (log.error if job["status"] not in sweep_jobs.FINE else log.info)(line)
        for line in more:
            log.info(line)
        log.info(
            "plots: `python scripts/plot_run.py %s` draws this sweep into %s",
            sweep_dir,
            sweep_dir / "plots",
        )


def _set_aside_report(sweep_dir: Path) -> None:
    """An earlier sweep's report in this dir (a stopped one resumed, or another sweep) moves
    with its journal to sweep.before-<n>/: this sweep writes its own."""
    if not (sweep_dir / _REPORT).exists():
        return
    aside = before(sweep_dir / "sweep")
    aside.mkdir()
    for name in (_REPORT, sweep_jobs.JOURNAL, SWEPT_KEYS_FILE):
        if (sweep_dir / name).exists():
            (sweep_dir / name).rename(aside / name)
    log.info("the earlier sweep's report in %s was moved to %s", sweep_dir, aside)


def _check_sweep_files(sweep_dir: Path) -> None:
    try:
        for name in _SWEEP_FILES:
            check_regular(sweep_dir / name, "the sweep's file", sweep_jobs.FILE_FIX)
    except UserError as e:
        log.error("error: %s", e)
        sys.exit(2)


def _check_sweeper_direction(config: DictConfig) -> None:
    """A sweeper's `direction` (Optuna's) must agree with trainer.monitor_mode: stop before the
    first job rather than search for the worst hyperparameters."""
    direction = OmegaConf.select(config, "hydra.sweeper.direction", default=None)
    mode = OmegaConf.select(config, "trainer.monitor_mode", default=None)
    if direction is None or mode is None or not isinstance(direction, (str, Enum)):
        return  # no such sweeper, or several objectives: nothing to compare
    direction = str(getattr(direction, "name", direction))
    mode = str(getattr(mode, "value", mode))
    wanted = {"min": "minimize", "max": "maximize"}.get(mode)
    if wanted is not None and direction != wanted:
        log.error(
            "error: hydra.sweeper.direction=%s does not match trainer.monitor_mode=%s "
            "(trainer.monitor=%s): add hydra.sweeper.direction=%s",
            direction,
            mode,
            OmegaConf.select(config, "trainer.monitor", default="?"),
            wanted,
        )
        sys.exit(2)


def _journal(config: DictConfig, **record: Any) -> None:
    """Append a line about this job to the journal (one short write: lines of jobs ending at
    once in other processes do not mix)."""
    record = {
        "num": OmegaConf.select(config, "hydra.job.num", default=None),
        "dir": os.path.abspath(OmegaConf.select(config, "hydra.runtime.output_dir") or "."),
        "time": round(time.time(), 3),
        **record,
    }
    path = Path(config.hydra.sweep.dir) / sweep_jobs.JOURNAL
    try:
        with open_regular(path, "a", what="the sweep's file", fix=sweep_jobs.FILE_FIX) as f:
            f.write(json.dumps(record) + "\n")
    except (OSError, UserError) as e:  # the report still finds the job by its dir
        log.warning("could not write %s: %s", path, e)


def _swept_keys(config: DictConfig) -> list[str]:
    task = OmegaConf.to_container(config.hydra.overrides.task)
    return swept_keys(task, OmegaConf.select(config, "hydra.sweeper.params", default=None))


def _is_multirun(config: DictConfig) -> bool:
    return OmegaConf.select(config, "hydra.mode") == RunMode.MULTIRUN
