"""Tracking: every rank's stats, a callback's `ctx.log` values, evaluations and the summary,
fanned out to sinks.

    tracker.py           Tracker: what the loop calls; the cross-rank gather and its aggregates
    names.py             every stat and aggregate name, defined once
    sink.py              RunInfo, the Sink base and what ctx.log accepts (the same for every sink)
    files.py             JSON lines under <output dir>/stats/ (always)
    tensorboard_sink.py  logger=tensorboard
    wandb_sink.py        logger=wandb: its layouts, run ids and throttling
    wandb_mode.py        W&B's mode (the login it would find), start timeout, one-line errors
    stats.py             what the loop records between log points (per-rank stats, memory)
    peak.py              the measured peak memory summary.json sets beside the memory plan
    console.py           what a person sees: rank 0's config tree, progress bar and summary

A user adds a sink as one module with a class meeting `hydra_ddp.protocols.Sink` and one YAML in
conf/logger/ naming it in `logger.sink._target_`; nothing here is meant to be edited.
"""

from hydra_ddp.tracking.files import set_aside_stats
from hydra_ddp.tracking.sink import Record, RunInfo, Sink
from hydra_ddp.tracking.tracker import Tracker

__all__ = ["Record", "RunInfo", "Sink", "Tracker", "set_aside_stats"]
