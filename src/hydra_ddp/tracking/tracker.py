"""The tracker: what the loop calls to record a job, fanning each record out to the sinks (the
stats files always, plus the one `logger.sink._target_` names).

A rank's own row goes to the sinks at once; the cross-rank part (the aggregates, W&B's `gather`
row) is one small asynchronous all_gather, read at the next log point or at `close`, so
training does not stall at every interval. It carries [key signature, queued ctx.log rows,
*stats]: the signature (a crc32 of the key names) makes mismatched keys fail loudly instead of
being mislabelled; the row count tells every rank whether a second, object gather of the queued
`ctx.log` values is needed (for a sink that writes other ranks' values from rank 0).
"""

from __future__ import annotations

import logging
import math
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

import torch
import torch.distributed as dist

from hydra_ddp.components import build
from hydra_ddp.config import Layout, LoggerConfig
from hydra_ddp.distributed import DistEnv, all_gather_objects
from hydra_ddp.tracking import names
from hydra_ddp.tracking.files import JsonFiles
from hydra_ddp.tracking.sink import Kind, Record, RunInfo, Sink, is_media, loggable_values

logger = logging.getLogger(__name__)

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

    def start(self, env: DistEnv) -> None:
        """Start the all_gather (float64) on every rank. `# collective`"""
        if not env.distributed:
            return
        self.signature = float(zlib.crc32("\0".join(self.keys).encode()))  # exact in a float64
        head = [self.signature, float(len(self.queued))]
        local = torch.tensor([*head, *self.values], dtype=torch.float64, device=env.device)
        self.gathered = [torch.empty_like(local) for _ in range(env.world_size)]
        self.work = dist.all_gather(self.gathered, local, async_op=True)

    def finish(
        self, env: DistEnv, exchange: bool
    ) -> Tuple[Dict[int, List[float]], List[Tuple[int, Queued]]]:
        """Every rank's values by rank, and (with `exchange`, when some rank queued any) the
        other ranks' queued ctx.log rows. `# collective` with `exchange`."""
        if self.work is None:
            return {env.rank: self.values}, []
        self.work.wait()
        rows = torch.stack(self.gathered).cpu().tolist()
        if any(row[0] != self.signature for row in rows):
            # Every rank sees every signature, so all ranks raise here together.
            raise RuntimeError(
                f"Tracker.log at step {self.step}: ranks passed different stat keys; every "
                "rank must log the same keys at every interval"
            )
        table = {r: row[2:] for r, row in enumerate(rows)}
        if exchange and any(row[1] for row in rows):  # the same decision on every rank
            return table, _exchange_values(env, self.queued)
        return table, []


class Tracker:
    """Records one job's per-rank stats, ctx.log values, evaluations and summary in its sinks."""

    def __init__(
        self, cfg: LoggerConfig, env: DistEnv, run: RunInfo, resumed_step: Optional[int] = None
    ) -> None:
        """`resumed_step`: the step of the checkpoint this job resumed from (None: from step 0).
        `# collective` for W&B: build it on every rank."""
        self.env, self.closed = env, False
        self.files = JsonFiles(run.output_dir, env, resumed_step)
        self.sinks: List[Sink] = [self.files]
        self.pending: Optional[Interval] = None
        self.queued: Queued = []  # this rank's ctx.log rows for rank 0 to forward
        self.stat_keys: Set[str] = set()  # what ctx.log may not reuse (sink.loggable_values)
        # (step, aggregates) of the newest interval whose gather completed, on rank 0.
        self.last_aggregate: Tuple[int, Dict[str, float]] = (0, {})
        self.forward = False  # whether other ranks' ctx.log values go to rank 0's sinks
        self.warned_media = False  # said once: media of other ranks are not forwarded
        try:
            if cfg.sink is not None:
                # Imported only when chosen: logger=none imports no W&B.
                sink = build(
                    cfg.sink, "logger.sink", logger_cfg=cfg, env=env, run=run,
                    resumed_step=resumed_step, stats_dir=self.files.dir,
                )  # fmt: skip
                self.sinks.append(sink)
                self.files.run_id = getattr(sink, "run_id", None)
                self.forward = env.distributed and getattr(sink, "gathers_values", False)
        except BaseException:
            self.close(failed=True)
            raise

    def log(self, step: int, stats: Mapping[str, float]) -> None:
        """Record this rank's stats for `step`. `# collective`: every rank, same keys."""
        if self.closed:
            raise RuntimeError("Tracker.log called after close()")
        keys = sorted(stats)
        self.stat_keys.update(keys)
        now = time.time()
        # Integers (samples_seen, data_bytes, ...) stay integers in the stats file.
        own = {k: stats[k] if type(stats[k]) is int else float(stats[k]) for k in keys}
        self._fan_out(Record(Kind.stats, self.env.rank, own, now), step)
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._finish(pending, exchange=True)
        queued, self.queued = self.queued, []
        interval = Interval(step, keys, [float(stats[k]) for k in keys], now, queued)
        interval.start(self.env)  # collective
        if interval.work is None:
            self._finish(interval, exchange=False)
        else:
            self.pending = interval

    def _finish(self, interval: Interval, exchange: bool) -> None:
        table, forwarded = interval.finish(self.env, exchange and self.forward)
        agg = aggregate(table, interval.keys) if self.env.is_main else {}
        if self.env.is_main:
            self.last_aggregate = (interval.step, agg)
        by_rank = {r: dict(zip(interval.keys, row)) for r, row in table.items()}
        record = Record(Kind.interval, self.env.rank, by_rank[self.env.rank], interval.time)
        record.table, record.aggregates = by_rank, agg
        self._fan_out(record, interval.step)
        self._forwarded(forwarded)

    def _forwarded(self, forwarded: List[Tuple[int, Queued]]) -> None:
        """Rank 0: the other ranks' ctx.log rows, to the sink that writes them (W&B gather);
        only gathered when `self.forward`."""
        if not self.env.is_main:
            return
        for rank, rows in forwarded:
            for step, row in rows:
                self.sinks[-1].log(Record(Kind.values, rank, row, time.time()), step)

    def log_values(self, step: int, new: Mapping[str, Any]) -> None:
        """A callback's `ctx.log` at `step` on this rank (ValueError: see sink.py). Not
        collective: ranks may log different keys at different steps."""
        checked = loggable_values(new, self.stat_keys)
        if self.closed or not checked:
            return
        self._fan_out(Record(Kind.values, self.env.rank, checked, time.time()), step)
        if self.forward and not self.env.is_main:
            plain = {k: v for k, v in checked.items() if not is_media(v)}
            if len(plain) < len(checked) and not self.warned_media:
                self.warned_media = True
                logger.warning(
                    "ctx.log at step %d: W&B media of rank %d are not sent (now and later) under "
                    "logger.layout=gather (only rank 0 has a run): use logger.layout=group",
                    step,
                    self.env.rank,
                )
            if plain:
                self.queued.append((step, plain))

    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        """Evaluation metrics keyed like `val/acc` or `test/loss` (rank 0 only)."""
        if self.env.is_main and not self.closed:
            floats = {k: float(v) for k, v in metrics.items()}
            self._fan_out(Record(Kind.eval, self.env.rank, floats, time.time()), step)

    def summary(self, metrics: Mapping[str, float]) -> None:
        """Final values (e.g. best `val/acc`), rank 0 only."""
        if self.env.is_main and not self.closed:
            for sink in self.sinks:
                sink.summary(dict(metrics))

    def add_config(self, config: Dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.add_config(config)

    def _fan_out(self, record: Record, step: int) -> None:
        for sink in self.sinks:
            sink.log(record, step)

    def close_all(self) -> None:
        """`# collective`, at the end of a successful run: hand rank 0 the last ctx.log rows,
        then close; under W&B's shared layout the primary (rank 0) finishes the run last."""
        self._hand_over()  # collective
        shared = self.env.distributed and getattr(self.sinks[-1], "layout", None) == Layout.shared
        if shared and not self.env.is_main:
            self.close()
        if self.env.distributed:
            dist.barrier()
        self.close()

    def _hand_over(self) -> None:
        """`# collective` where values are forwarded: the last interval and the ctx.log rows
        queued since, to rank 0."""
        if not self.forward or self.closed:
            return
        pending, self.pending = self.pending, None
        if pending is not None:
            self._finish(pending, exchange=True)
        queued, self.queued = self.queued, []
        self._forwarded(_exchange_values(self.env, queued))  # collective

    def close(self, failed: bool = False, preempted: int = 0) -> None:
        """Complete the last interval, close every sink; idempotent. Not collective, but on
        success every rank must call it (the last interval's gather is waited for)."""
        if self.closed:
            return
        error: Optional[BaseException] = None
        pending, self.pending = self.pending, None
        # After a failure a peer may be gone: only an interval already gathered is kept.
        if pending is not None and (not failed or pending.work.is_completed()):
            try:
                self._finish(pending, exchange=False)
            except Exception as e:  # still close the sinks
                error, failed = e, True
        self.closed = True
        for sink in reversed(self.sinks):  # the files last: they hold what W&B may not have
            try:
                sink.close(failed=failed, preempted=preempted)
            except Exception:
                logger.exception("could not close %s", type(sink).__name__)
        if error is not None:
            raise error

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is not None:
            self.close(failed=True)


def _exchange_values(env: DistEnv, mine: Queued) -> List[Tuple[int, Queued]]:
    """Every rank's queued ctx.log rows, by rank. `# collective`"""
    everyone = all_gather_objects(mine, env)
    return [(r, rows) for r, rows in enumerate(everyone) if rows and r != env.rank]


def aggregate(table: Dict[int, List[float]], keys: List[str]) -> Dict[str, float]:
    """Cross-rank aggregates of one interval; `table` maps rank -> values in key order."""
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
        if name.endswith(names.THROUGHPUT_SUFFIX):
            # The job's throughput (samples or tokens): ranks process disjoint items in parallel.
            agg[name + names.TOTAL_SUFFIX] = sum(column.values())
    if names.LOSS in columns:
        agg[names.LOSS_MEAN] = sum(columns[names.LOSS].values()) / len(table)
    return agg
