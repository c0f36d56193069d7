"""Seed groups of a sweep: jobs whose swept overrides differ only in the seed, each group's
statistics and the comparison of the best two (what each figure means: docs/sweeps.md, "Seeds").
"""

from __future__ import annotations

import math
import statistics
import warnings
from typing import Any, Sequence

from hydra_ddp.rundir.sweep_jobs import aligned, cell, scored

LEVEL = 0.95  # the confidence of each interval
ALPHA = 0.05  # the tests' level, two-sided
POWER = 0.80  # the power the seeds-needed figure is for
MAX_SEEDS = 10_000  # beyond this the figure says "more than"
POWER_CALCULATION = (
    f"two-sample t-test, two-sided, {ALPHA:.0%} level, {POWER:.0%} power, at the two groups' "
    "difference of means and pooled standard deviation"
)


def summarise(
    jobs: list[dict[str, Any]], seed_keys: list[str], monitor: str, mode: str
) -> tuple[dict[str, Any], str, list[str]]:
    """The report's JSON (groups, the comparison of the best two, jobs marked `best` in the best
    group), the best group in a few words, and the lines for the log."""
    entries = groups(jobs, seed_keys, mode)
    best = entries[0] if entries and entries[0]["best"] else None
    for job in jobs:
        # Of the best group, the jobs its figures come from: not a failed or pruned one.
        job["best"] = best is not None and job["job"] in best["jobs"] and scored(job)
    comparison = compare(*entries[:2]) if best is not None and len(entries) > 1 else None
    report = {"monitor": monitor, "mode": mode, "seed_keys": seed_keys, "groups": entries,
              "comparison": comparison, "jobs": jobs}  # fmt: skip
    lines = [f"seed groups ({','.join(seed_keys)}), ranked by their mean {monitor} ({mode}):"]
    lines += group_table(entries, monitor, mode)
    lines += [comparison_line(comparison)] if comparison is not None else []
    said = f"best group {best['group']}: mean {best['mean']:.6g} of {best['n']} seed(s)"
    return report, said if best is not None else "no job has one", lines


def groups(jobs: list[dict[str, Any]], seed_keys: Sequence[str], mode: str) -> list[dict]:
    """One entry per configuration (the swept overrides but the seed keys), best first."""
    members: dict[tuple, list[dict[str, Any]]] = {}
    for job in jobs:
        config = tuple((k, v) for k, v in job["overrides"].items() if k not in seed_keys)
        members.setdefault(config, []).append(job)
    entries = []
    for config, group in members.items():
        scored_jobs = [j for j in group if scored(j)]
        names = sorted({n for j in scored_jobs for n in j["metrics"]})
        entries.append(
            {
                "group": " ".join(f"{k}={v}" for k, v in config) or "(one configuration)",
                "overrides": dict(config),
                **describe([j["objective"] for j in scored_jobs]),
                # `0`; `0,1` for two seed keys.
                "seeds": [
                    ",".join(str(j["overrides"][k]) for k in seed_keys if k in j["overrides"])
                    for j in scored_jobs
                ],
                "jobs": [j["job"] for j in group],
                # failed, stopped, pruned, or no finite objective (diverged)
                "unscored": len(group) - len(scored_jobs),
                "metrics": {
                    name: describe(
                        [j["metrics"][name] for j in scored_jobs if name in j["metrics"]]
                    )
                    for name in names
                },
                "objectives": [j["objective"] for j in scored_jobs],
            }
        )
    sign = 1 if mode == "min" else -1
    entries.sort(key=lambda g: (g["n"] == 0, sign * g["mean"] if g["n"] else 0.0))
    for rank, entry in enumerate(entries, 1):
        entry["rank"] = rank
        entry["best"] = rank == 1 and entry["n"] > 0
    return entries


def describe(values: list[float]) -> dict[str, Any]:
    """n, mean, sample std, min, max, the Student's t interval of the mean; None for too few."""
    from scipy import stats

    n = len(values)
    mean = math.fsum(values) / n if n else None
    std = statistics.stdev(values) if n > 1 else None
    interval = None
    if n > 1:
        half = float(stats.t.ppf(1 - (1 - LEVEL) / 2, n - 1)) * std / math.sqrt(n)
        interval = [mean - half, mean + half]
    return {
        "n": n,
        "mean": mean,
        "std": std,
        "min": min(values, default=None),
        "max": max(values, default=None),
        "interval": interval,
    }


def compare(best: dict[str, Any], runner_up: dict[str, Any]) -> dict[str, Any]:
    from scipy import stats

    result: dict[str, Any] = {"best": best["group"], "next": runner_up["group"]}
    a, b = best["objectives"], runner_up["objectives"]
    if len(a) < 2 or len(b) < 2:
        result["verdict"] = "cannot tell: each group needs at least 2 seeds with an objective"
        return result
    lo_a, hi_a = best["interval"]
    lo_b, hi_b = runner_up["interval"]
    result["intervals_overlap"] = lo_a <= hi_b and lo_b <= hi_a
    with warnings.catch_warnings():  # identical values: scipy warns, and says inf or NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        result["welch_p"] = float(stats.ttest_ind(a, b, equal_var=False).pvalue)
        seeds_a, seeds_b = best["seeds"], runner_up["seeds"]
        paired = sorted(seeds_a) == sorted(seeds_b) and len(set(seeds_a)) == len(seeds_a)
        by_seed = dict(zip(seeds_b, b))
        result["paired_p"] = (
            float(stats.ttest_rel(a, [by_seed[s] for s in seeds_a]).pvalue) if paired else None
        )
    result["test"] = "paired t-test" if paired else "Welch's t-test"
    p = result["paired_p"] if paired else result["welch_p"]
    result["distinguishable"] = bool(p < ALPHA)  # NaN (no difference, no spread): False
    n_a, n_b = len(a), len(b)
    pooled = math.sqrt(
        ((n_a - 1) * best["std"] ** 2 + (n_b - 1) * runner_up["std"] ** 2) / (n_a + n_b - 2)
    )
    result["seeds_needed"] = seeds_needed(abs(best["mean"] - runner_up["mean"]), pooled)
    result["power_calculation"] = POWER_CALCULATION
    return result


def seeds_needed(difference: float, std: float) -> int | None:
    """The fewest seeds per group at which a two-sample t-test (two-sided, ALPHA) detects
    `difference` with POWER at standard deviation `std`, from the noncentral t distribution.
    None: no difference, or over MAX_SEEDS."""
    import numpy as np
    from scipy import stats

    if difference == 0:
        return None
    if std == 0:
        return 2  # no spread: any two seeds tell them apart
    n = np.arange(2, MAX_SEEDS + 1)
    df = 2 * n - 2
    critical = stats.t.ppf(1 - ALPHA / 2, df)
    shift = difference / std * np.sqrt(n / 2)
    power = stats.nct.sf(critical, df, shift) + stats.nct.cdf(-critical, df, shift)
    enough = np.flatnonzero(power >= POWER)
    return int(n[enough[0]]) if enough.size else None


def comparison_line(comparison: dict[str, Any]) -> str:
    head = f"best vs next: {comparison['best']} vs {comparison['next']}: "
    if "verdict" in comparison:
        return head + comparison["verdict"]
    tests = [f"Welch's t-test {_p(comparison['welch_p'])}"]
    if comparison["test"] == "paired t-test":
        tests.insert(0, f"paired t-test over the same seeds {_p(comparison['paired_p'])}")
    overlap = "overlap" if comparison["intervals_overlap"] else "do not overlap"
    needed = comparison["seeds_needed"]
    seeds = (
        f"{needed} seed(s) per group would tell them apart"
        if needed is not None
        else f"no number of seeds up to {MAX_SEEDS} would tell them apart"
    )
    return (
        head
        + ("distinguishable" if comparison["distinguishable"] else "not distinguishable")
        + f" at the {ALPHA:.0%} level ({'; '.join(tests)}; the {LEVEL:.0%} intervals {overlap});"
        + f" at the spread seen, {seeds} ({POWER_CALCULATION})"
    )


def _p(p: float | None) -> str:
    # NaN (null in the JSON): both groups gave the same value at every seed.
    return f"p={p:.3g}" if p is not None and math.isfinite(p) else "p undefined (no difference)"


def group_table(entries: list[dict[str, Any]], monitor: str, mode: str) -> list[str]:
    names = sorted({n for g in entries for n in g["metrics"]})
    header = ["", "rank", "n", f"{monitor} ({mode}) mean", "std", f"{LEVEL:.0%} interval"]
    header += ["min", "max", *(f"{n} mean" for n in names), "group"]
    rows = [
        [
            "*" if g["best"] else "",
            str(g["rank"]),
            str(g["n"]) + (f" (+{g['unscored']} unscored)" if g["unscored"] else ""),
            cell(g["mean"]),
            cell(g["std"]),
            f"{cell(g['interval'][0])} .. {cell(g['interval'][1])}" if g["interval"] else "-",
            cell(g["min"]),
            cell(g["max"]),
            *(cell(g["metrics"].get(n, {}).get("mean")) for n in names),
            g["group"],
        ]
        for g in entries
    ]
    return aligned([header, *rows])
