"""Sweeps of DDP jobs: a failed job's record, and the report at the end.

`SweepReport` is a Hydra callback that tables every job of this sweep at the end of a multirun
(status, objective, metrics, and for a failed job why and where its logs are; a job a pruning
sweep stopped early is PRUNED, with the step it reached, and counts as no failure); a sweep
over seeds adds its seed groups (seed_groups.py). Job dir names are paths.sweep_subdir's; each
job's objective is the metric `trainer.monitor` names (loop.evaluation.monitor_key). The values of
secret keys (redact.py) are blanked in the report, its table and the journal, as in the job dir
names, and in the Optuna sweeper's optimization_results.yaml.
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

from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from hydra_ddp import redact
from hydra_ddp.disk import check_regular, open_regular
from hydra_ddp.errors import UserError
from hydra_ddp.launcher_env import JOB_STARTED_ENV, STOP_SIGNALS, launcher_rank
from hydra_ddp.rundir import claim, jsonfile, seed_groups, sweep_jobs
from hydra_ddp.rundir.paths import SWEPT_KEYS_FILE, swept_keys

log = logging.getLogger(__name__)

_sweep_failed = False
# The sweep this process runs, from its start to its report: (the report callback, its config).
_running: tuple[SweepReport, DictConfig] | None = None

_REPORT = "sweep_report.json"
_SWEEPER_RESULTS = "optimization_results.yaml"  # the Optuna sweeper's
# Every file of the sweep dir that a sweep opens: the report's, and Hydra's own (its basic
# sweeper writes multirun.yaml after on_multirun_start, before the first job). A FIFO there
# would block the sweep for ever, holding its claim.
_SWEEP_FILES = (sweep_jobs.JOURNAL, SWEPT_KEYS_FILE, _REPORT, "multirun.yaml", _SWEEPER_RESULTS)


def record_failure(output_dir: Path, message: str, status: str = "FAILED") -> None:
    """Mark a job of a sweep as failed (or, with status="PREEMPTED", stopped on request), for
    SweepReport to find. Global rank 0 writes it: under a submitit sweep every task of the job
    gets here, and a peer of a failed rank fails too."""
    if launcher_rank() != 0:
        return
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    record = {"error": message, **({"status": status} if status != "FAILED" else {})}
    jsonfile.write(Path(output_dir) / "failure.json", record, indent=None)


def record_not_started(config: DictConfig, job_dir: Path, overrides: list[str]) -> None:
    """Journal a job that a stopped sweep never started (a launcher with a queue: Ray's), so
    the report lists it as PREEMPTED rather than as a job that left no trace."""
    record = {"dir": os.path.abspath(job_dir), "event": "not_started", "overrides": overrides}
    _journal(config, **record)


def report_stopped() -> None:
    """The report of a sweep that a stop ended in its own process (the basic launcher: a job
    stopped on a signal ends its sweep with it; submitit's: `_stop_on_signals`), as at a
    sweep's end."""
    if _running is not None:
        callback, config = _running
        callback.on_multirun_end(config)


def _stop_on_signals() -> None:
    """A submitit sweep's process only submits its jobs and waits: SIGTERM, SIGUSR1 or SIGUSR2
    would kill it without a word, its report unwritten and its claim held. Each now ends it as
    a stopped sweep (one line, the report, exit 128 + the signal). Its jobs are the
    scheduler's and run on; they stop on their own signals (scancel, or a kill of a local one)."""

    def stop(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        log.warning(
            "sweep stopped on %s: its submitted jobs run on under submitit (SLURM: scancel)", name
        )
        raise SystemExit(128 + signum)

    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), stop)


def sweep_failed() -> bool:
    """True when the sweep that just ran in this process had a failing job."""
    return _sweep_failed


class SweepReport(Callback):
    """At the end of a multirun, a table of every job: its swept overrides, status, objective
    (`trainer.monitor`, best job marked), main validation metrics and, for a failed job, why
    and where its logs are; written to the log and to <sweep dir>/sweep_report.json.

    Jobs are found from the journal <sweep dir>/sweep_jobs.jsonl (a line as each starts and
    ends, whatever process runs it: the basic launcher's or submitit's) and by looking for job
    dirs, so a job whose dir is missing or that wrote no summary.json is reported as failed.
    Each job's rank 0 leaves what Hydra got back from it (what a sweeper such as Optuna's
    optimises) in <job dir>/job_return.json.

    `seed_keys`: the keys whose values are seeds (hydra.callbacks.sweep_report.seed_keys, in
    conf/train.yaml); a sweep over one of them is reported by seed group too."""

    def __init__(self, seed_keys: Sequence[str] = ()) -> None:
        self.seed_keys = [str(k) for k in seed_keys]

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _sweep_failed
        _sweep_failed = False
        _check_sweeper_direction(config)
        sweep_dir = Path(config.hydra.sweep.dir)
        _check_sweep_files(sweep_dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        # Before anything is written or submitted: a live sweep's dir is refused in one line.
        claim.claim_sweep(sweep_dir)
        keys = swept_keys(
            OmegaConf.to_container(config.hydra.overrides.task),
            OmegaConf.select(config, "hydra.sweeper.params", default=None),
        )
        jsonfile.write(sweep_dir / SWEPT_KEYS_FILE, keys, indent=None)
        # A sweep rerun into the same dir starts its journal afresh, with the time it started:
        # job dirs found there that no job of this sweep has written since are another run's.
        # Not an Optuna sweep run again: it continues its study, whose trials those jobs are.
        journal = sweep_dir / sweep_jobs.JOURNAL
        optuna = "hydra_ddp_optuna" in str(OmegaConf.select(config, "hydra.sweeper._target_"))
        if not (optuna and sweep_jobs.read_journal(journal)[1] is not None):
            start = {"event": "sweep_start", "time": round(time.time(), 3)}
            journal.write_text(json.dumps(start) + "\n")
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
        # A launcher that starts a process per job (hydra/launcher=ray) says when it did:
        # the job's start-up is then from there, not from here.
        started = os.environ.get(JOB_STARTED_ENV)
        _journal(
            config,
            event="start",
            # The values of secret keys (redact.py) stay in the job's own .hydra/ record.
            overrides=redact.overrides(OmegaConf.to_container(config.hydra.overrides.task)),
            **({"process_start": float(started)} if started else {}),
        )

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        if job_return.hydra_cfg is None or launcher_rank() != 0:
            return  # under submitit every task of a job gets here: rank 0 speaks for the job
        output_dir = Path(job_return.hydra_cfg.hydra.runtime.output_dir)
        if job_return.status == JobStatus.FAILED:
            # A job that raised past launch/command.py's own handling (a bug) still gets marked.
            record_failure(output_dir, repr(job_return._return_value))
        if _is_multirun(job_return.hydra_cfg):
            value = job_return._return_value if job_return.status == JobStatus.COMPLETED else None
            number = float(value) if isinstance(value, (int, float)) else None
            # A job stopped on a signal under Ray or submitit returns (NaN): its record says so.
            failure = sweep_jobs.read_side_file(output_dir / "failure.json")
            returned = {
                "status": failure.get("status", "FAILED") if failure else job_return.status.name,
                "return_type": type(value).__name__,
                # JSON has no NaN: a failed job's NaN objective is written as null.
                "return_value": jsonfile.finite_or_none(number),
            }
            jsonfile.write(output_dir / sweep_jobs.JOB_RETURN, returned, indent=None)
            # `config`, not the copy in job_return: that one lost the resolved `${now:}` of the
            # sweep dir's name.
            _journal(config, event="end", **returned)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global _running
        _running = None
        try:
            _blank_sweeper_results(Path(config.hydra.sweep.dir))
            self._report(config)
        finally:
            claim.release_sweep()  # the sweep is over: its dir is free for the next

    def _report(self, config: DictConfig) -> None:
        global _sweep_failed
        # Hydra turns an exception here into a warning: a report that could not be made must
        # not pass for a sweep without failures.
        _sweep_failed = True
        # Absolute, so the paths in the report and on the console work from anywhere.
        sweep_dir = Path(os.path.abspath(config.hydra.sweep.dir))
        monitor = str(OmegaConf.select(config, "trainer.monitor", default="val/loss"))
        mode = OmegaConf.select(config, "trainer.monitor_mode", default="min")
        mode = str(getattr(mode, "value", mode))
        keys = swept_keys(
            OmegaConf.to_container(config.hydra.overrides.task),
            OmegaConf.select(config, "hydra.sweeper.params", default=None),
        )
        jobs = sweep_jobs.collect(sweep_dir, keys, monitor, mode)
        seeds = [k for k in self.seed_keys if k in keys]
        if seeds:
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


def _check_sweep_files(sweep_dir: Path) -> None:
    """Refuse, in one line and before anything is written or claimed, a sweep dir where a file
    the sweep opens is no regular file (a FIFO would block the sweep for ever)."""
    try:
        for name in _SWEEP_FILES:
            check_regular(sweep_dir / name, "the sweep's file", sweep_jobs.FILE_FIX)
    except UserError as e:
        log.error("error: %s", e)
        sys.exit(2)


def _blank_sweeper_results(sweep_dir: Path) -> None:
    """The Optuna sweeper writes the best trial's parameters to <sweep dir>/
    optimization_results.yaml just before this runs (after its last trial): the values of
    secret keys among them (redact.py) are blanked there, as in the report."""
    path = sweep_dir / _SWEEPER_RESULTS
    if not path.is_file():  # another sweeper, or none
        return
    try:
        results = OmegaConf.to_container(OmegaConf.load(path))
        blanked = redact.config(results)
        if blanked != results:
            tmp = path.with_name(f".{path.name}.tmp")
            OmegaConf.save(OmegaConf.create(blanked), tmp)
            os.replace(tmp, path)
    except Exception as e:  # unreadable or unwritable: say so, the report still comes
        log.warning("could not blank the secret values in %s: %s", path, e)


def _check_sweeper_direction(config: DictConfig) -> None:
    """A sweeper with a `direction` (Optuna's) must optimise the way trainer.monitor_mode says:
    stop before the first job rather than search for the worst hyperparameters."""
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
    """Append one line about this job to <sweep dir>/sweep_jobs.jsonl (one short write, so the
    lines of jobs ending at the same time in other processes do not mix)."""
    record = {
        "num": OmegaConf.select(config, "hydra.job.num", default=None),
        "dir": os.path.abspath(OmegaConf.select(config, "hydra.runtime.output_dir") or "."),
        # When: whether jobs ran side by side (hydra/launcher=ray) is read from these.
        "time": round(time.time(), 3),
        **record,
    }
    path = Path(config.hydra.sweep.dir) / sweep_jobs.JOURNAL
    try:
        with open_regular(path, "a", what="the sweep's file", fix=sweep_jobs.FILE_FIX) as f:
            f.write(json.dumps(record) + "\n")
    except (OSError, UserError) as e:  # the report still finds the job by its dir
        log.warning("could not write %s: %s", path, e)


def _is_multirun(config: DictConfig) -> bool:
    from hydra.types import RunMode

    return OmegaConf.select(config, "hydra.mode") == RunMode.MULTIRUN
