#!/usr/bin/env python
"""Plot a job's per-rank stats so stragglers and memory gaps stand out, or a sweep's picture.

    python scripts/plot_run.py <output dir> [--out DIR] [--stats loss,step_time,...]
    python scripts/plot_run.py <sweep dir>  [--out DIR] [--stats loss,step_time,...]

Reads ``<output dir>/stats/rank*.jsonl`` (written by ``hydra_ddp.tracking`` on every rank,
whatever the sink, ``logger=...``, is) and draws one PNG per stat, e.g. ``<out>/loss.png``, with
one line per rank against the optimizer step. Legends carry each rank's mean (max for memory),
so the slow or memory-hungry rank can be read off without squinting.

Given a sweep dir (``multirun/<date>/<time>``, whose job dirs hold ``stats/``), each PNG has one
line per job instead, labelled by the job dir's name (``0_model=mlp``): at each step the mean
over the job's ranks (their max for memory stats, judged by their peak), so jobs of different
world sizes compare. From its ``sweep_report.json``, per configuration (a seed group, else a job):
``<monitor>_by_group.png``, the monitored metric (each job's ``stats/eval.jsonl``) against the
step, the mean over seeds and a band from their min to their max; ``objective_by_<key>.png``
for each swept key but the seeds, each job's final objective as a point and the mean per
configuration as a line, one for each value of the other keys.

``--out`` defaults to ``<dir>/plots``. Exits with status 2 and a one-line message when there
are no stats.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

logger = logging.getLogger("plot_run")

DEFAULT_STATS = ("loss", "step_time", "data_wait", "rss_mb", "cuda_mem_mb", "samples_per_s")
# Memory is judged by its peak, everything else by its typical value.
_PEAK_STATS = {"rss_mb", "peak_rss_mb", "cuda_mem_mb"}
_UNITS = {
    "step_time": "s",
    "data_wait": "s",
    "rss_mb": "MiB",
    "peak_rss_mb": "MiB",
    "cuda_mem_mb": "MiB",
    "samples_per_s": "samples/s",
}
_RANK_FILE = re.compile(r"rank(\d+)\.jsonl$")

Series = Dict[str, List[Tuple[float, float]]]  # stat -> [(step, value), ...]


def read_rank_stats(stats_dir: Path) -> Dict[int, Series]:
    """Load every ``rank{r}.jsonl`` in ``stats_dir`` as rank -> stat -> [(step, value)]."""
    ranks: Dict[int, Series] = {}
    for path in sorted(stats_dir.glob("rank*.jsonl")):
        match = _RANK_FILE.search(path.name)
        if match is None or not path.is_file():  # a FIFO would block the read for ever
            continue
        series: Series = {}
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                # A rank killed mid-write leaves a torn last line; the rest is still good.
                logger.warning("%s:%d: skipping a line that is not JSON", path, lineno)
                continue
            step = record.get("step")
            if not isinstance(step, (int, float)):
                continue
            for key, value in record.items():
                if key in ("step", "time", "rank"):
                    continue
                if value is None:  # NaN and inf, as files written before they were kept
                    series.setdefault(key, []).append((float(step), math.nan))
                elif value in ("nan", "inf", "-inf"):  # NaN and inf, as written now
                    series.setdefault(key, []).append((float(step), float(value)))
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    series.setdefault(key, []).append((float(step), float(value)))
        ranks[int(match.group(1))] = series
    return ranks


def read_sweep_stats(sweep_dir: Path) -> Dict[str, Dict[int, Series]]:
    """Every job dir under ``sweep_dir`` that holds ``stats/rank*.jsonl``, as its name (its path
    under the sweep dir) -> its ranks' stats, in job order (``10_...`` after ``9_...``)."""
    found = []
    for root, dirs, _ in os.walk(sweep_dir):
        stats = Path(root) / "stats"
        if "stats" in dirs and any(stats.glob("rank*.jsonl")) and Path(root) != sweep_dir:
            found.append(Path(root))
            dirs.clear()  # a job dir holds no other job
    jobs: Dict[str, Dict[int, Series]] = {}
    for job_dir in sorted(found, key=lambda p: _job_order(p.relative_to(sweep_dir))):
        ranks = read_rank_stats(job_dir / "stats")
        if ranks:
            jobs[job_dir.relative_to(sweep_dir).as_posix()] = ranks
    return jobs


def read_sweep_report(sweep_dir: Path) -> Optional[Tuple[List[dict], List[dict], List[str]]]:
    """The sweep's jobs, its configurations (seed groups, or one per job) and its seed keys, from
    ``sweep_report.json``; None without a readable one."""
    path = sweep_dir / "sweep_report.json"
    try:
        report = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError):
        report = None
    if isinstance(report, list):  # a sweep without seeds: each job its own configuration
        groups = [{"group": _overrides(j["overrides"]), "jobs": [j["job"]]} for j in report]
        return report, groups, []
    if isinstance(report, dict) and isinstance(report.get("jobs"), list):
        return report["jobs"], report["groups"], list(report.get("seed_keys") or [])
    return None


def read_evaluations(job_dir: Path, key: str) -> Dict[float, float]:
    """step -> the value of ``key`` (``val/loss``) in ``<job dir>/stats/eval.jsonl``; the last
    line for a step wins (a resumed job evaluates it again)."""
    path = job_dir / "stats" / "eval.jsonl"
    if not path.is_file():
        return {}
    values: Dict[float, float] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a torn last line
        if not isinstance(record, dict):
            continue
        step, value = record.get("step"), record.get(key)
        if isinstance(step, (int, float)) and isinstance(value, (int, float)):
            values[float(step)] = float(value)
    return values


def plot_groups_over_steps(
    sweep_dir: Path, jobs: List[dict], groups: List[dict], out: Path
) -> Optional[Path]:
    """The monitored metric against the step per configuration: the mean over its jobs (seeds)
    and a band from their min to their max; None when no job evaluated it."""
    from matplotlib.ticker import MaxNLocator

    monitor = next((j["monitor"] for j in jobs if j.get("monitor")), "val/loss")
    by_name = {j["job"]: j for j in jobs}
    curves = {}
    for group in groups:
        runs = [_job_dir(sweep_dir, by_name[n]) for n in group["jobs"] if n in by_name]
        found = [c for c in (read_evaluations(d, monitor) for d in runs) if c]
        if found:
            curves[f"{_short(group['group'])} (n={len(found)})"] = found
    if not curves:
        return None
    path = out / f"{_file_name(monitor)}_by_group.png"
    title = f"{monitor} per configuration: mean over seeds, band min to max"
    with _figure(path, title, "step", monitor) as ax:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        for label, found in curves.items():
            steps = sorted({s for c in found for s in c})
            at = [[c[s] for c in found if s in c] for s in steps]
            marker = "o" if len(steps) <= 30 else None
            mean = [sum(v) / len(v) for v in at]
            (line,) = ax.plot(steps, mean, linewidth=1.6, marker=marker, markersize=3, label=label)
            if len(found) > 1:
                low, high = [min(v) for v in at], [max(v) for v in at]
                ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    return path


def plot_objective_by_key(jobs: List[dict], seed_keys: List[str], out: Path) -> List[Path]:
    """For each swept key but the seeds: each job's final objective against the key's value (a
    point per job), and the mean per configuration, joined for each value of the other keys."""
    scored = [j for j in jobs if j.get("status") == "ok" and j.get("objective") is not None]
    keys = dict.fromkeys(k for j in scored for k in j["overrides"] if k not in seed_keys)
    written = []
    for key in keys:
        values = sorted({str(j["overrides"].get(key)) for j in scored}, key=_value_order)
        numeric = all(_number(v) is not None for v in values)
        place = {v: (_number(v) if numeric else float(i)) for i, v in enumerate(values)}
        lines: Dict[str, Dict[str, List[float]]] = {}  # the other keys' values -> points
        for j in scored:
            others = {k: v for k, v in j["overrides"].items() if k not in (key, *seed_keys)}
            line = lines.setdefault(_overrides(others) or "mean", {})
            line.setdefault(str(j["overrides"].get(key)), []).append(j["objective"])
        monitor, mode = scored[0].get("monitor", "objective"), scored[0].get("mode", "")
        path = out / f"objective_by_{_file_name(key)}.png"
        title = f"final {monitor} by {key}: a point per job, the line the mean"
        with _figure(path, title, key, f"final {monitor} ({mode})") as ax:
            for label, points in lines.items():
                xs = sorted(points, key=lambda v: place[v])
                means = [sum(points[v]) / len(points[v]) for v in xs]
                x = [place[v] for v in xs]
                (mean_line,) = ax.plot(x, means, marker="s", label=_short(label))
                for v in xs:
                    x = [place[v]] * len(points[v])
                    ax.scatter(x, points[v], s=14, alpha=0.6, color=mean_line.get_color())
            low, high = min(place.values()), max(place.values())
            if numeric and 0 < low and high >= 10 * low:  # lr=1e-4,1e-3,1e-2: evenly apart
                ax.set_xscale("log")
            if not numeric:
                ax.set_xticks(list(place.values()), [_short(v, 20) for v in values])
        written.append(path)
    return written


@contextlib.contextmanager
def _figure(path: Path, title: str, xlabel: str, ylabel: str) -> Iterator[Any]:
    """Axes to draw on, then labelled, legended and saved to ``path``."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    try:
        yield ax
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize=8, ncol=2 if len(ax.get_lines()) > 8 else 1)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


def _job_dir(sweep_dir: Path, job: dict) -> Path:
    """The job's dir as the report says, or under the sweep dir if that moved since."""
    recorded = Path(job["dir"]) if job.get("dir") else None
    return recorded if recorded is not None and recorded.is_dir() else sweep_dir / job["job"]


def _overrides(overrides: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in overrides.items())


def _number(text: str) -> Optional[float]:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _value_order(text: str) -> Tuple[int, float, str]:
    number = _number(text)
    return (0, number, text) if number is not None else (1, 0.0, text)


def _short(text: str, width: int = 48) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _file_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]", "_", text)


def _job_order(name: Path) -> Tuple[int, str]:
    head = name.parts[0].split("_", 1)[0]
    return (int(head) if head.isdigit() else sys.maxsize, name.as_posix())


def across_ranks(ranks: Dict[int, Series], stat: str) -> List[Tuple[float, float]]:
    """One job's line for ``stat``: at each step the mean over the ranks that logged it (the max
    for memory stats); NaN where no rank had a finite value."""
    by_step: Dict[float, List[float]] = {}
    for series in ranks.values():
        for step, value in series.get(stat, []):
            by_step.setdefault(step, []).append(value)
    points = []
    for step in sorted(by_step):
        finite = [v for v in by_step[step] if math.isfinite(v)]
        if not finite:
            points.append((step, math.nan))
        elif stat in _PEAK_STATS:
            points.append((step, max(finite)))
        else:
            points.append((step, sum(finite) / len(finite)))
    return points


def _label(name: str, stat: str, values: List[float]) -> str:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return name
    if stat in _PEAK_STATS:
        return f"{name} (max {max(finite):.4g})"
    return f"{name} (mean {sum(finite) / len(finite):.4g})"


def plot_stat(ranks: Dict[int, Series], stat: str, out: Path, title: str) -> Optional[Path]:
    """Draw one stat for every rank into ``out/<stat>.png``; None when no rank has it."""
    lines = {f"rank {r}": s[stat] for r, s in sorted(ranks.items()) if s.get(stat)}
    return _draw(lines, stat, out, f"{stat} per rank: {title}")


def plot_sweep_stat(
    jobs: Dict[str, Dict[int, Series]], stat: str, out: Path, title: str
) -> Optional[Path]:
    """Draw one stat for every job of a sweep into ``out/<stat>.png`` (see `across_ranks`);
    None when no job has it."""
    lines = {}
    for name, ranks in jobs.items():
        points = across_ranks(ranks, stat)
        if points:
            lines[name if len(name) <= 48 else name[:45] + "..."] = points
    return _draw(lines, stat, out, f"{stat} per job (mean over ranks): {title}")


def _draw(
    lines: Dict[str, List[Tuple[float, float]]], stat: str, out: Path, title: str
) -> Optional[Path]:
    from matplotlib.ticker import MaxNLocator

    if not lines:
        return None
    unit = _UNITS.get(stat)
    path = out / f"{stat}.png"
    with _figure(path, title, "step", f"{stat} [{unit}]" if unit else stat) as ax:
        for name, points in lines.items():
            steps = [p[0] for p in points]
            values = [p[1] for p in points]
            marker = "o" if len(points) <= 30 else None
            label = _label(name, stat, values)
            ax.plot(steps, values, marker=marker, markersize=3, linewidth=1.4, label=label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    return path


def main(argv: Optional[List[str]] = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "output_dir", type=Path, help="a job's output dir (holds stats/), or a sweep dir"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where to write the PNGs (default: <output_dir>/plots)",
    )
    parser.add_argument(
        "--stats",
        default=",".join(DEFAULT_STATS),
        help="comma-separated stats to plot (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    stats_dir = args.output_dir / "stats"
    ranks = read_rank_stats(stats_dir) if stats_dir.is_dir() else {}
    # Not a job dir: a sweep dir, whose job dirs hold the stats.
    jobs = {} if ranks or not args.output_dir.is_dir() else read_sweep_stats(args.output_dir)
    if not ranks and not jobs:
        print(
            f"error: no stats files found: expected {stats_dir}/rank*.jsonl (a job's output "
            f"dir) or {args.output_dir}/<job>/stats/rank*.jsonl (a sweep dir), written by a "
            "hydra-ddp run",
            file=sys.stderr,
        )
        return 2

    import matplotlib

    matplotlib.use("Agg")  # files only: works on headless nodes
    out = args.out if args.out is not None else args.output_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    title = str(args.output_dir)
    if len(title) > 60:
        title = "..." + title[-57:]
    report = read_sweep_report(args.output_dir) if jobs else None
    if report is not None:
        # Job dirs an earlier sweep into the same dir left are not this sweep's.
        listed = {j["job"] for j in report[0]}
        jobs = {n: r for n, r in jobs.items() if Path(n).name in listed} or jobs
    everything = list(ranks.values()) or [s for job in jobs.values() for s in job.values()]
    written = []
    for stat in [s.strip() for s in args.stats.split(",") if s.strip()]:
        if stat == "cuda_mem_mb" and not any(
            v for s in everything for _, v in s.get(stat, []) if math.isfinite(v)
        ):
            continue  # CPU run: an all-zero memory plot says nothing
        if ranks:
            path = plot_stat(ranks, stat, out, title)
        else:
            path = plot_sweep_stat(jobs, stat, out, title)
        if path is None:
            logger.info("no %s in the stats; skipped", stat)
        else:
            written.append(path)
    if report is not None:
        sweep_jobs, groups, seed_keys = report
        path = plot_groups_over_steps(args.output_dir, sweep_jobs, groups, out)
        written += [path] if path is not None else []
        written += plot_objective_by_key(sweep_jobs, seed_keys, out)
    elif jobs:
        logger.info("no sweep_report.json in %s: per-job lines only", args.output_dir)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
