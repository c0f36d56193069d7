"""The cross-rank part of each log interval: one small asynchronous all_gather of every
rank's stats, and the aggregates rank 0 derives from them.

The gather starts when the interval is logged and is read at the next log point (or at close),
so training does not stall at every interval. It carries [key signature, queued ctx.log rows,
*stats] as float64: the signature (a crc32 of the key names) makes mismatched keys fail loudly
instead of being mislabelled; the row count tells every rank whether a second, object gather of
the queued `ctx.log` values is needed (only sinks that write other ranks' values from rank 0,
W&B's `gather` layout, ask for it; see Tracker).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from hydra_ddp.distributed import DistEnv, all_gather_objects
from hydra_ddp.tracking import names

Queued = List[Tuple[int, Dict[str, Any]]]  # (step, ctx.log values) of one rank


@dataclass
class Interval:
    """One log interval's stats on this rank, and its all_gather while in flight."""

    step: int
    keys: List[str]
    values: List[float]
    time: float
    queued: Queued = field(default_factory=list)  # this rank's ctx.log rows to hand to rank 0
    signature: float = 0.0
    gathered: List[torch.Tensor] = field(default_factory=list)  # the all_gather's output, by rank
    work: Optional[Any] = None  # the async all_gather's handle; None when not distributed


def start(env: DistEnv, interval: Interval) -> Interval:
    """Start the interval's all_gather (float64) on every rank. `# collective`"""
    if not env.distributed:
        return interval
    # crc32 fits a float64 exactly.
    interval.signature = float(zlib.crc32("\0".join(interval.keys).encode()))
    head = [interval.signature, float(len(interval.queued))]
    local = torch.tensor([*head, *interval.values], dtype=torch.float64, device=env.device)
    interval.gathered = [torch.empty_like(local) for _ in range(env.world_size)]
    interval.work = dist.all_gather(interval.gathered, local, async_op=True)
    return interval


def finish(
    env: DistEnv, interval: Interval, exchange: bool
) -> Tuple[Dict[int, List[float]], List[Tuple[int, Queued]]]:
    """Wait for the interval's gather: every rank's values by rank, and (with `exchange`, when
    some rank queued any) every other rank's queued ctx.log rows, on every rank.
    `# collective` when `exchange`."""
    if interval.work is None:
        return {env.rank: interval.values}, []
    interval.work.wait()
    rows = torch.stack(interval.gathered).cpu().tolist()
    if any(row[0] != interval.signature for row in rows):
        # Every rank sees every signature, so all ranks raise here together.
        raise RuntimeError(
            f"Tracker.log at step {interval.step}: ranks passed different stat keys; every "
            "rank must log the same keys at every interval"
        )
    table = {r: row[2:] for r, row in enumerate(rows)}
    queued: List[Tuple[int, Queued]] = []
    if exchange and any(row[1] for row in rows):  # the same decision on every rank
        queued = exchange_values(env, interval.queued)
    return table, queued


def exchange_values(env: DistEnv, mine: Queued) -> List[Tuple[int, Queued]]:
    """Every rank's queued ctx.log rows, by rank. `# collective`"""
    everyone = all_gather_objects(mine, env)
    return [(r, rows) for r, rows in enumerate(everyone) if rows and r != env.rank]


def aggregate(table: Dict[int, List[float]], keys: List[str]) -> Dict[str, float]:
    """Cross-rank aggregates of one log interval; `table` maps rank -> values in key order."""
    agg: Dict[str, float] = {}
    columns = {k: {r: row[i] for r, row in table.items()} for i, k in enumerate(keys)}
    for name in names.SPREAD:
        per_rank = {r: v for r, v in columns.get(name, {}).items() if math.isfinite(v)}
        if not per_rank:
            continue
        values = list(per_rank.values())
        agg[names.spread(name, "min")] = min(values)
        agg[names.spread(name, "mean")] = sum(values) / len(values)
        agg[names.spread(name, "max")] = max(values)
        agg[names.slowest(name)] = float(max(per_rank, key=lambda r: per_rank[r]))
    for name, column in columns.items():
        if names.is_throughput(name):
            # The job's throughput (samples or tokens): ranks process disjoint items in parallel.
            agg[name + names.TOTAL_SUFFIX] = sum(column.values())
    if names.LOSS in columns:
        agg[names.LOSS_MEAN] = sum(columns[names.LOSS].values()) / len(table)
    return agg
