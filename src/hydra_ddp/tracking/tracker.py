"""The tracker: what the loop calls to record a job, fanning each record out to the sinks.

Every rank calls `Tracker.log` at each log interval with the same stat keys. Its own row goes to
the sinks at once (the stats file first: it is always there); the cross-rank part (gather.py:
the aggregates, and W&B's row, which holds every rank's stats in the `gather` layout) completes
at the next log point or at `close`, so training does not stall at every interval.

The sinks: the JSON-lines files (files.py) always, plus the one `logger.sink._target_` names,
built like any component (components.build). A new sink is a module with a class meeting
`hydra_ddp.protocols.Sink` (tensorboard_sink.py is one, in 50 lines) and a YAML in conf/logger/;
nothing here changes.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

import torch.distributed as dist

from hydra_ddp.components import build
from hydra_ddp.config import Layout, LoggerConfig
from hydra_ddp.distributed import DistEnv
from hydra_ddp.tracking import gather, values
from hydra_ddp.tracking.files import JsonFiles
from hydra_ddp.tracking.sink import Kind, Record, RunInfo, Sink

logger = logging.getLogger(__name__)


class Tracker:
    """Records one job's per-rank stats, ctx.log values, evaluations and summary in its sinks."""

    def __init__(
        self, cfg: LoggerConfig, env: DistEnv, run: RunInfo, resumed_step: Optional[int] = None
    ) -> None:
        """`resumed_step`: the step of the checkpoint this job resumed from (None: it started
        from step 0). `# collective` for W&B's `group` and `shared` layouts: build it on every
        rank."""
        self.env, self.closed = env, False
        self.files = JsonFiles(run.output_dir, env, resumed_step)
        self.sinks: List[Sink] = [self.files]
        self.pending: Optional[gather.Interval] = None
        self.queued: gather.Queued = []  # this rank's ctx.log rows for rank 0 to forward
        self.stat_keys: Set[str] = set()  # what ctx.log may not reuse (values.loggable_values)
        # (step, aggregates) of the newest interval whose gather completed, on rank 0.
        self.last_aggregate: Tuple[int, Dict[str, float]] = (0, {})
        self.forward = False  # whether other ranks' ctx.log values go to rank 0's sinks
        self.warned_media = False  # said once: media of other ranks are not forwarded
        try:
            if cfg.sink is not None:
                # What the sink may ask for by name (hydra_ddp.protocols.Sink); its YAML's
                # arguments come with it. The module is imported only when chosen: logger=none
                # imports no W&B.
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
        """Record this rank's stats for `step`. `# collective`: every rank, same keys.

        This rank's own row is written at once; the cross-rank part completes at the next call
        or at `close` (see `last_aggregate`)."""
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
        interval = gather.Interval(step, keys, [float(stats[k]) for k in keys], now, queued)
        interval = gather.start(self.env, interval)  # collective
        if interval.work is None:
            self._finish(interval, exchange=False)
        else:
            self.pending = interval

    def _finish(self, interval: gather.Interval, exchange: bool) -> None:
        """Wait for an interval's gather; hand its aggregates and rows to the sinks."""
        table, forwarded = gather.finish(self.env, interval, exchange and self.forward)
        agg = gather.aggregate(table, interval.keys) if self.env.is_main else {}
        if self.env.is_main:
            self.last_aggregate = (interval.step, agg)
        by_rank = {r: dict(zip(interval.keys, row)) for r, row in table.items()}
        record = Record(Kind.interval, self.env.rank, by_rank[self.env.rank], interval.time)
        record.table, record.aggregates = by_rank, agg
        self._fan_out(record, interval.step)
        self._forwarded(forwarded)

    def _forwarded(self, forwarded: List[Tuple[int, gather.Queued]]) -> None:
        """Rank 0: the other ranks' ctx.log rows, to the sinks that write them (W&B gather)."""
        if not self.env.is_main:
            return
        for rank, rows in forwarded:
            for step, row in rows:
                record = Record(Kind.values, rank, row, time.time())
                for sink in self.sinks[1:]:
                    if getattr(sink, "gathers_values", False):
                        sink.log(record, step)

    def log_values(self, step: int, new: Mapping[str, Any]) -> None:
        """A callback's `ctx.log` at `step` on this rank, under the rule of values.py (a
        reserved key or a value of no sink's type: ValueError). Not collective: ranks may log
        different keys at different steps."""
        checked = values.loggable_values(new, self.stat_keys)
        if self.closed or not checked:
            return
        self._fan_out(Record(Kind.values, self.env.rank, checked, time.time()), step)
        if self.forward and not self.env.is_main:
            plain = {k: v for k, v in checked.items() if not values.is_media(v)}
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
        """Record evaluation metrics keyed like `val/acc` or `test/loss` (rank 0 only)."""
        if self.env.is_main and not self.closed:
            floats = {k: float(v) for k, v in metrics.items()}
            self._fan_out(Record(Kind.eval, self.env.rank, floats, time.time()), step)

    def summary(self, metrics: Mapping[str, float]) -> None:
        """Set final values (e.g. best `val/acc`) in stats/summary.json and W&B (rank 0)."""
        if self.env.is_main and not self.closed:
            for sink in self.sinks:
                sink.summary(dict(metrics))

    def add_config(self, config: Dict[str, Any]) -> None:
        """More of the run's config (e.g. its provenance), where a sink records config."""
        for sink in self.sinks:
            sink.add_config(config)

    def _fan_out(self, record: Record, step: int) -> None:
        for sink in self.sinks:
            sink.log(record, step)

    def close_all(self) -> None:
        """`# collective`, at the end of a successful run: hand rank 0 the last ctx.log rows,
        then close on every rank; with W&B's shared layout the other ranks first, so the
        primary finishes the run last."""
        self._hand_over()  # collective
        shared = self.env.distributed and getattr(self.sinks[-1], "layout", None) == Layout.shared
        if shared and not self.env.is_main:
            self.close()
        if self.env.distributed:
            dist.barrier()
        self.close()

    def _hand_over(self) -> None:
        """`# collective` where values are forwarded: the last interval and the ctx.log rows
        queued since, to rank 0, at the end of a run."""
        if not self.forward or self.closed:
            return
        pending, self.pending = self.pending, None
        if pending is not None:
            self._finish(pending, exchange=True)
        queued, self.queued = self.queued, []
        self._forwarded(gather.exchange_values(self.env, queued))  # collective

    def close(self, failed: bool = False, preempted: int = 0) -> None:
        """Complete the last interval, close every sink. Idempotent. `failed`: the run failed;
        `preempted` (the signal's number): stopped by it. Not collective, but on success every
        rank must call it (the last interval's gather is waited for). Other ranks' ctx.log rows
        not yet handed to rank 0 (close_all does) stay in their stats files only."""
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
        """Leaving a `with tracker:` block on an error closes it as failed."""
        if exc is not None:
            self.close(failed=True)


def make_tracker(
    cfg: LoggerConfig, env: DistEnv, run: RunInfo, resumed_step: Optional[int] = None
) -> Tracker:
    """Build the tracker for one job (`logger=none`, no `logger.sink`: the stats files only).

    `resumed_step`: the step of the checkpoint the job resumed from, or None when it started
    from step 0; a resumed job continues its files and the W&B runs recorded in its output dir."""
    return Tracker(cfg, env, run, resumed_step=resumed_step)
