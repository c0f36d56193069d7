#!/usr/bin/env python
"""Plot a job's per-rank stats so stragglers and memory gaps stand out, or a sweep's jobs
side by side.

    python scripts/plot_run.py <output dir> [--out DIR] [--stats loss,step_time,...]
    python scripts/plot_run.py <sweep dir>  [--out DIR] [--stats loss,step_time,...]

Reads ``<output dir>/stats/rank*.jsonl`` (written by ``hydra_ddp.tracking`` on every rank,
whatever the sink, ``logger=...``, is) and draws one PNG per stat, e.g. ``<out>/loss.png``, with
one line per rank against the optimizer step. Legends carry each rank's mean (max for memory),
so the slow or memory-hungry rank can be read off without squinting.

Given a sweep dir (``multirun/<date>/<time>``, whose job dirs hold ``stats/``), each PNG has one
line per job instead, labelled by the job dir's name (``0_model=mlp``): at each step the mean
over the job's ranks (their max for memory stats, judged by their peak), so jobs of different
world sizes compare. ``--out`` defaults to ``<dir>/plots``. Exits with status 2 and a one-line
message when there are no stats.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

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
        if match is None:
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
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    try:
        for name, points in lines.items():
            steps = [p[0] for p in points]
            values = [p[1] for p in points]
            ax.plot(
                steps,
                values,
                marker="o" if len(points) <= 30 else None,
                markersize=3,
                linewidth=1.4,
                label=_label(name, stat, values),
            )
        unit = _UNITS.get(stat)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.set_xlabel("step")
        ax.set_ylabel(f"{stat} [{unit}]" if unit else stat)
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize=8, ncol=2 if len(lines) > 8 else 1)
        fig.tight_layout()
        path = out / f"{stat}.png"
        fig.savefig(path)
        return path
    finally:
        plt.close(fig)


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
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
