"""Sweeps of DDP jobs: a failed job's record, and the report at the end.

`SweepReport` is a Hydra callback that tables every job at the end of a multirun (status,
objective, metrics, and for a failed job why and where its logs are; a job a pruning sweep
stopped early is PRUNED, with the step it reached, and counts as no failure). Job dir names are
paths.sweep_subdir's; each job's objective is the metric `trainer.monitor` names
(monitor.monitor_key). The values of secret keys (redact.py) are blanked in the report, its
table and the journal, as in the job dir names, and in the Optuna sweeper's
optimization_results.yaml.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from hydra_ddp.distributed import launcher_rank
from hydra_ddp.rundir import claim, jsonfile
from hydra_ddp.rundir.paths import SWEPT_KEYS_FILE, split_override, swept_keys
from hydra_ddp.tracking import redact

log = logging.getLogger(__name__)

_sweep_failed = False
# The sweep this process runs, from its start to its report: (the report callback, its config).
_running: tuple[SweepReport, DictConfig] | None = None

_JOURNAL = "sweep_jobs.jsonl"
# Set by a launcher that starts a process per job: when it started this job's (time.time()).
STARTED_ENV = "HYDRA_DDP_JOB_STARTED"
# A job a pruning sweep stopped early on purpose: reported, not failed.
PRUNED = "PRUNED"
_FINE = ("ok", PRUNED)
_JOB_RETURN = "job_return.json"
_SWEEPER_RESULTS = "optimization_results.yaml"  # the Optuna sweeper's


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
    stopped on a signal ends its sweep with it), as at a sweep's end."""
    if _running is not None:
        callback, config = _running
        callback.on_multirun_end(config)


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
    optimises) in <job dir>/job_return.json."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _sweep_failed
        _sweep_failed = False
        _check_sweeper_direction(config)
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        # Before anything is written or submitted: a live sweep's dir is refused in one line.
        claim.claim_sweep(sweep_dir)
        keys = swept_keys(
            OmegaConf.to_container(config.hydra.overrides.task),
            OmegaConf.select(config, "hydra.sweeper.params", default=None),
        )
        jsonfile.write(sweep_dir / SWEPT_KEYS_FILE, keys, indent=None)
        # A sweep rerun into the same dir starts its journal afresh.
        (sweep_dir / _JOURNAL).write_text("")
        global _running
        _running = (self, config)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not _is_multirun(config) or launcher_rank() != 0:
            return
        output_dir = Path(config.hydra.runtime.output_dir)
        # A sweep rerun into the same sweep dir must not report the previous run's outcome.
        for name in ("failure.json", _JOB_RETURN):
            (output_dir / name).unlink(missing_ok=True)
        # A launcher that starts a process per job (hydra/launcher=ray) says when it did:
        # the job's start-up is then from there, not from here.
        started = os.environ.get(STARTED_ENV)
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
            # A job that raised past distributed/entry.py's own handling (a bug) still gets marked.
            record_failure(output_dir, repr(job_return._return_value))
        if _is_multirun(job_return.hydra_cfg):
            value = job_return._return_value if job_return.status == JobStatus.COMPLETED else None
            number = float(value) if isinstance(value, (int, float)) else None
            returned = {
                "status": job_return.status.name,
                "return_type": type(value).__name__,
                # JSON has no NaN: a failed job's NaN objective is written as null.
                "return_value": jsonfile.finite_or_none(number),
            }
            jsonfile.write(output_dir / _JOB_RETURN, returned, indent=None)
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
        jobs = [
            _job_entry(job, keys, monitor, mode)
            for job in _find_jobs(sweep_dir, _read_journal(sweep_dir / _JOURNAL))
        ]
        scored = [j for j in jobs if j["status"] == "ok" and j["objective"] is not None]
        best = (min if mode == "min" else max)(scored, key=lambda j: j["objective"], default=None)
        for j in jobs:
            j["best"] = j is best
        jsonfile.write(sweep_dir / "sweep_report.json", jobs)
        failed = [j for j in jobs if j["status"] not in _FINE]
        _sweep_failed = bool(failed)
        pruned = sum(j["status"] == PRUNED for j in jobs)
        log.info(
            "sweep done: %d job(s), %d failed%s; objective %s (%s): %s; report: %s",
            len(jobs),
            len(failed),
            f", {pruned} pruned" if pruned else "",
            monitor,
            mode,
            f"best {best['objective']:.6g} ({best['job']})" if best else "no job has one",
            sweep_dir / "sweep_report.json",
        )
        header, *lines = _table(jobs, monitor, mode)
        log.info(header)
        for job, line in zip(jobs, lines):
            (log.error if job["status"] not in _FINE else log.info)(line)


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
    path = Path(config.hydra.sweep.dir) / _JOURNAL
    try:
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as e:  # the report still finds the job by its dir
        log.warning("could not write %s: %s", path, e)


def _read_journal(path: Path) -> dict[str, dict[str, Any]]:
    """Job dir -> what the journal says of it (its start and end merged)."""
    jobs: dict[str, dict[str, Any]] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return jobs
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a torn line of a job killed while writing it
        if isinstance(record, dict) and "dir" in record:
            job = jobs.setdefault(record["dir"], {})
            # A start after the first: the job was requeued (preemption, time limit) or rerun.
            starts = job.get("starts", 0) + (record.get("event") == "start")
            job.update(record, starts=starts)
    return jobs


def _find_jobs(sweep_dir: Path, journal: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every job of the sweep, in launch order: those in the journal, every dir with a .hydra/
    dump under the sweep dir (a subdir may nest), and a placeholder for each job number missing
    between them (a job that left no trace)."""
    jobs = {d: dict(record) for d, record in journal.items()}
    for root, dirs, _ in os.walk(sweep_dir):
        if ".hydra" in dirs:
            jobs.setdefault(os.path.abspath(root), {})
            dirs.clear()  # a job dir holds no other job
    for job_dir, record in jobs.items():
        if record.get("num") is None:
            record["num"] = _job_number(Path(job_dir))
        record["dir"] = job_dir
    numbers = {r["num"] for r in jobs.values() if isinstance(r["num"], int)}
    if numbers and len(numbers) == len(jobs):
        for num in sorted(set(range(max(numbers) + 1)) - numbers):
            jobs[f"#{num}"] = {"num": num, "dir": None}
    return sorted(
        jobs.values(),
        key=lambda r: (r["num"] if isinstance(r["num"], int) else sys.maxsize, str(r["dir"])),
    )


def _job_number(job_dir: Path) -> int | None:
    """The number the job dir's name starts with (`10_...` is job 10), else .hydra's."""
    head = job_dir.name.split("_", 1)[0]
    if head.isdigit():
        return int(head)
    try:
        num = OmegaConf.load(job_dir / ".hydra" / "hydra.yaml").hydra.job.num
        return int(num)
    except Exception:  # no dump, or no number in it
        return None


def _job_entry(record: dict[str, Any], keys: list[str], monitor: str, mode: str) -> dict[str, Any]:
    """One row of the report, from the journal's record and what the job left in its dir."""
    num, job_dir = record["num"], record["dir"]
    saved = _read_yaml(Path(job_dir) / ".hydra" / "overrides.yaml") if job_dir else None
    overrides = record.get("overrides")
    if overrides is None:
        overrides = list(saved) if isinstance(saved, list) else []
    # What the report must not repeat: the values of the job's secret keys (redact.py).
    secrets = [v for k, v in map(split_override, saved or overrides) if v and redact.is_secret(k)]
    swept = dict(split_override(line) for line in redact.overrides(overrides))
    swept = {k: v for k, v in swept.items() if k in keys}
    summary: dict[str, Any] = {}
    logs: list[str] = []
    if job_dir is None:
        status, detail = "FAILED", f"job {num} left no dir (see the launcher's log)"
    elif record.get("event") == "not_started" and not Path(job_dir).is_dir():
        status, detail = "PREEMPTED", "not started: the sweep was stopped before it"
    elif not Path(job_dir).is_dir():
        status, detail = "FAILED", f"its dir is missing: {job_dir}"
    else:
        path = Path(job_dir)
        logs = sorted(str(p) for p in path.glob("*.log"))
        failure = jsonfile.read(path / "failure.json")
        summary = jsonfile.read(path / "summary.json") or {}
        if failure is not None:
            status = str(failure.get("status", "FAILED"))
            detail = _scrub(str(failure.get("error", failure)), secrets)
        elif summary.get("pruned"):  # a pruning sweep's pruner stopped it (loop/pruning.py)
            status, detail = PRUNED, f"pruned at step {summary.get('steps')}"
        elif summary:
            status, detail = "ok", None
        else:
            status, detail = "FAILED", "no summary.json (the job died)"
    objective = record.get("return_value")
    if objective is None and job_dir is not None:
        objective = (jsonfile.read(Path(job_dir) / _JOB_RETURN) or {}).get("return_value")
    if objective is None and status == "ok":
        objective = summary.get("objective")
    if not isinstance(objective, (int, float)) or not math.isfinite(objective):
        objective = None
    return {
        "job": Path(job_dir).name if job_dir else f"#{num}",
        "num": num,
        "overrides": swept,
        "status": status,
        # The step it reached (a pruned job's is where it was stopped).
        "steps": summary.get("steps"),
        "monitor": monitor,
        "mode": mode,
        "objective": objective,
        "metrics": {k: v for k, v in summary.items() if k.startswith("val_")},
        "detail": detail,
        # How often it was started again (a requeue after a time limit or a preemption).
        "requeued": max(int(record.get("starts", 1)) - 1, 0),
        "dir": job_dir,
        "logs": logs,
    }


def _table(jobs: list[dict[str, Any]], monitor: str, mode: str) -> list[str]:
    """The report as aligned text: a header line, then one line per job (`*`: the best)."""
    names = [n for n in ("val_loss",) if any(n in j["metrics"] for j in jobs)]
    names += sorted({n for j in jobs for n in j["metrics"]} - {"val_loss"})
    header = ["", "status", "job", f"{monitor} ({mode})", *names, "overrides"]
    rows = [
        [
            "*" if j["best"] else "",
            j["status"] + (f" (requeued {j['requeued']}x)" if j.get("requeued") else ""),
            j["job"],
            _cell(j["objective"]),
            *(_cell(j["metrics"].get(n)) for n in names),
            _ellipsize(" ".join(f"{k}={v}" for k, v in j["overrides"].items()) or "-", 60),
        ]
        for j in jobs
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for j, row in zip([None, *jobs], [header, *rows]):
        line = "  " + " ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
        if j is not None and j["status"] == PRUNED:
            line += f"  {j['detail']}"
        elif j is not None and j["status"] != "ok":
            # The whole error is in the JSON report; here a line stays a line.
            line += (
                f"  {_ellipsize(str(j['detail']), 300)} (logs: {', '.join(j['logs']) or j['dir']})"
            )
        lines.append(line)
    return lines


def _scrub(text: str, secrets: list[str]) -> str:
    """`text` with each of `secrets` (and the live W&B API key) blanked."""
    for value in sorted(secrets, key=len, reverse=True):
        text = text.replace(value, redact.REDACTED)
    return redact.text(text)


def _cell(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, (int, float)) else "-"


def _ellipsize(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _is_multirun(config: DictConfig) -> bool:
    from hydra.types import RunMode

    return OmegaConf.select(config, "hydra.mode") == RunMode.MULTIRUN


def _read_yaml(path: Path) -> Any:
    try:
        return OmegaConf.to_container(OmegaConf.load(path))
    except Exception:  # missing or unreadable: the caller falls back
        return None
