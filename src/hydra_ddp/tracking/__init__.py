"""Tracking: every rank's stats, a callback's `ctx.log` values, evaluations and the summary,
fanned out to sinks.

    tracker.py           Tracker: what the loop calls; builds the sink and fans records out
    names.py             every stat and aggregate name, defined once
    gather.py            the cross-rank gather of each log interval and its aggregates
    values.py            what ctx.log accepts (the same rule for every sink)
    sink.py              RunInfo, Record and the Sink base (contract: hydra_ddp.protocols.Sink)
    files.py             JSON lines under <output dir>/stats/ (always)
    tensorboard_sink.py  logger=tensorboard
    wandb_sink.py        logger=wandb: its layouts, run ids and throttling
    wandb_mode.py        W&B's mode (the login it would find), start timeout, one-line errors
    stats.py             what the loop records between log points (per-rank stats, memory)
    console.py           what a person sees: rank 0's config tree, progress bar and summary

A user adds a sink as one module with a class meeting `hydra_ddp.protocols.Sink` and one YAML in
conf/logger/ naming it in `logger.sink._target_`; nothing here is meant to be edited.
"""

from hydra_ddp.tracking.files import set_aside_stats
from hydra_ddp.tracking.names import STEP_METRIC
from hydra_ddp.tracking.sink import Record, RunInfo, Sink
from hydra_ddp.tracking.tracker import Tracker, make_tracker
from hydra_ddp.tracking.wandb_mode import resolve_mode
from hydra_ddp.tracking.wandb_sink import physical_gpu

__all__ = [
    "STEP_METRIC",
    "Record",
    "RunInfo",
    "Sink",
    "Tracker",
    "make_tracker",
    "physical_gpu",
    "resolve_mode",
    "set_aside_stats",
]
