"""A sweep's jobs as its report lists them, one row each, found from the journal (a line as the
sweep starts and as each job starts and ends) and the job dirs; and the report's job table.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from hydra_ddp import redact
from hydra_ddp.disk import read_regular
from hydra_ddp.errors import UserError
from hydra_ddp.rundir import jsonfile
from hydra_ddp.rundir.paths import split_override

JOURNAL = "sweep_jobs.jsonl"
JOB_RETURN = "job_return.json"
# A job a pruning sweep stopped early on purpose: reported, not failed.
PRUNED = "PRUNED"
FINE = ("ok", PRUNED)
FILE_FIX = "remove it (the sweep writes its own there), or choose another hydra.sweep.dir"


def collect(sweep_dir: Path, keys: list[str], monitor: str, mode: str) -> list[dict[str, Any]]:
    journal, started = read_journal(sweep_dir / JOURNAL)
    return [job_entry(job, keys, monitor, mode) for job in find_jobs(sweep_dir, journal, started)]


def scored(job: dict[str, Any]) -> bool:
    """Only a finished job's objective counts: a pruned job's value is from an earlier step."""
    return job["status"] == "ok" and job["objective"] is not None


def mark_best(jobs: list[dict[str, Any]], mode: str) -> str:
    ranked = [j for j in jobs if scored(j)]
    top = (min if mode == "min" else max)(ranked, key=lambda j: j["objective"], default=None)
    for j in jobs:
        j["best"] = j is top
    return f"best {top['objective']:.6g} ({top['job']})" if top else "no job has one"


def read_journal(path: Path) -> tuple[dict[str, dict[str, Any]], float | None]:
    """Job dir -> its journal records merged, and when the sweep started (None: not said)."""
    jobs: dict[str, dict[str, Any]] = {}
    started = None
    try:
        lines = read_regular(path, what="the sweep's file", fix=FILE_FIX).splitlines()
    except (OSError, UserError):
        return jobs, started
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a torn line of a job killed while writing it
        if isinstance(record, dict) and record.get("event") == "sweep_start":
            started = float(record["time"])
        elif isinstance(record, dict) and "dir" in record:
            job = jobs.setdefault(record["dir"], {})
            # A start after the first: the job was requeued (preemption, time limit) or rerun.
            starts = job.get("starts", 0) + (record.get("event") == "start")
            job.update(record, starts=starts)
    return jobs, started


def find_jobs(
    sweep_dir: Path, journal: dict[str, dict[str, Any]], started: float | None
) -> list[dict[str, Any]]:
    """Every job of this sweep in launch order: the journal's, each dir under the sweep dir with
    a .hydra/ dump written since the sweep `started`, and a placeholder for each missing number
    (a job that left no trace)."""
    jobs = {d: dict(record) for d, record in journal.items()}
    for root, dirs, _ in os.walk(sweep_dir):
        if ".hydra" in dirs:
            # A re-run writes .hydra.2, ... (paths.hydra_subdir). One second of slack: the
            # start's time is rounded, a file system's clock may lag.
            dumps = [os.path.join(root, d) for d in dirs if d.startswith(".hydra")]
            if started is None or _newest(dumps) >= started - 1:
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


def _newest(paths: list[str]) -> float:
    times = []
    for path in paths:
        try:
            times.append(os.path.getmtime(path))
        except OSError:
            pass
    return max(times, default=0.0)


def _job_number(job_dir: Path) -> int | None:
    """The number the job dir's name starts with (`10_...` is job 10), else .hydra's."""
    head = job_dir.name.split("_", 1)[0]
    if head.isdigit():
        return int(head)
    try:
        return int(_read_yaml(job_dir / ".hydra" / "hydra.yaml")["hydra"]["job"]["num"])
    except Exception:  # no dump, or no number in it
        return None


def job_entry(record: dict[str, Any], keys: list[str], monitor: str, mode: str) -> dict[str, Any]:
    num, job_dir = record["num"], record["dir"]
    saved = _read_yaml(Path(job_dir) / ".hydra" / "overrides.yaml") if job_dir else None
    overrides = record.get("overrides")
    if overrides is None:
        overrides = list(saved) if isinstance(saved, list) else []
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
        try:
            failure = jsonfile.read(path / "failure.json")
            summary = jsonfile.read(path / "summary.json") or {}
        except UserError as e:  # a FIFO, say, where the job's record should be
            failure, summary = {"error": str(e)}, {}
        if failure is not None:
            # A summary.json beside it is an earlier run's in this dir, not this job's figures.
            summary = {}
            status = str(failure.get("status", "FAILED"))
            detail = str(failure.get("error", failure))
            for value in sorted(secrets, key=len, reverse=True):
                detail = detail.replace(value, redact.REDACTED)
            detail = redact.text(detail)  # and the live W&B API key
        elif summary.get("pruned"):  # a pruning sweep's pruner stopped it (loop/evaluation.py)
            status, detail = PRUNED, f"pruned at step {summary.get('steps')}"
        elif summary:
            status, detail = "ok", None
        else:
            status, detail = "FAILED", "no summary.json (the job died)"
    objective = record.get("return_value")
    if objective is None and job_dir is not None:
        objective = read_side_file(Path(job_dir) / JOB_RETURN).get("return_value")
    if objective is None and status == "ok":
        objective = summary.get("objective")
    if not isinstance(objective, (int, float)) or not math.isfinite(objective):
        objective = None
    return {
        "job": Path(job_dir).name if job_dir else f"#{num}",
        "num": num,
        "overrides": swept,
        "status": status,
        "steps": summary.get("steps"),
        "monitor": str(summary.get("monitor", monitor)),  # its own, where a swept key set it
        "mode": mode,
        "objective": objective,
        "metrics": {k: v for k, v in summary.items() if k.startswith("val_")},
        "detail": detail,
        "requeued": max(int(record.get("starts", 1)) - 1, 0),
        "dir": job_dir,
        "logs": logs,
    }


def counts(jobs: list[dict[str, Any]]) -> str:
    """`3 job(s), 0 failed, 1 stopped, 2 not started`: a stopped job is no failed one."""
    stopped = [j for j in jobs if j["status"] == "PREEMPTED"]
    not_started = sum(not (j["dir"] and Path(j["dir"]).is_dir()) for j in stopped)
    counts = {
        "failed": sum(j["status"] not in (*FINE, "PREEMPTED") for j in jobs),
        "stopped": len(stopped) - not_started,
        "not started": not_started,
        "pruned": sum(j["status"] == PRUNED for j in jobs),
    }
    shown = [f"{n} {what}" for what, n in counts.items() if n or what == "failed"]
    return ", ".join([f"{len(jobs)} job(s)", *shown])


def job_table(jobs: list[dict[str, Any]], monitor: str, mode: str) -> list[str]:
    """The report as aligned text: a header line, then one line per job (`*`: the best)."""
    names = [n for n in ("val_loss",) if any(n in j["metrics"] for j in jobs)]
    names += sorted({n for j in jobs for n in j["metrics"]} - {"val_loss"})
    header = ["", "status", "job", f"{monitor} ({mode})", *names, "overrides"]
    rows = [
        [
            "*" if j["best"] else "",
            j["status"] + (f" (requeued {j['requeued']}x)" if j.get("requeued") else ""),
            j["job"],
            cell(j["objective"]),
            *(cell(j["metrics"].get(n)) for n in names),
            _ellipsize(" ".join(f"{k}={v}" for k, v in j["overrides"].items()) or "-", 60),
        ]
        for j in jobs
    ]
    lines = aligned([header, *rows])
    for i, j in enumerate(jobs, 1):
        if j["status"] == PRUNED:
            lines[i] += f"  {j['detail']}"
        elif j["status"] != "ok":  # the whole error is in the JSON report
            logs = ", ".join(j["logs"]) or j["dir"]
            lines[i] += f"  {_ellipsize(str(j['detail']), 300)} (logs: {logs})"
    return lines


def aligned(rows: list[list[str]]) -> list[str]:
    """`rows` as lines of left-aligned columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + " ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def cell(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, (int, float)) else "-"


def _ellipsize(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _read_yaml(path: Path) -> Any:
    try:
        text = read_regular(path, what="file", fix=FILE_FIX)
        return OmegaConf.to_container(OmegaConf.create(text))
    except Exception:  # missing, unreadable or no regular file: the caller falls back
        return None


def read_side_file(path: Path) -> dict[str, Any]:
    """A job's JSON side file; {} when it is missing, no JSON or no regular file."""
    try:
        found = jsonfile.read(path)
    except UserError:
        return {}
    return found if isinstance(found, dict) else {}
