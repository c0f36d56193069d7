"""What every sink gets: the records of one job, and the interface a sink implements.

A sink is a small class (torchtitan's `components/metrics.py` shape): `log(record, step)` for
each record and `close()` at the end, plus `summary(values)` and `add_config(values)` where it
has a use for them. The tracker (tracker.py) hands each record to every sink of the job; a sink
keeps what it wants and ignores the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Dict, List


@dataclass
class RunInfo:
    """What the tracker needs to know about the job it records."""

    output_dir: Path  # the job's output dir, shared by all ranks
    job_name: str  # e.g. "model=cnn,sampler=sharded" in a sweep, or "train"
    group: str  # one per sweep (or per job when not sweeping)
    config: dict  # the resolved config as plain containers (the run's W&B config)
    overrides: List[str] = field(default_factory=list)  # the job's command-line overrides


class Kind(Enum):
    stats = "stats"  # this rank's training stats of one log interval, as soon as logged
    interval = "interval"  # the same interval once every rank's stats are gathered
    values = "values"  # a callback's ctx.log values (of `rank`, which may be another rank)
    eval = "eval"  # evaluation metrics keyed like val/acc (rank 0 only)


@dataclass
class Record:
    """One thing to record at one step."""

    kind: Kind
    rank: int  # whose values these are
    values: Dict[str, Any]  # stats, ctx.log values or metrics (see values.py for their types)
    time: float  # time.time() when it was logged
    # Kind.interval: every rank's stats by rank (float) and, on rank 0, the aggregates.
    table: Dict[int, Dict[str, float]] = field(default_factory=dict)
    aggregates: Dict[str, float] = field(default_factory=dict)


class Sink:
    """A place records go to. Subclasses override what they use."""

    def log(self, record: Record, step: int) -> None:
        raise NotImplementedError

    def summary(self, values: Dict[str, float]) -> None:
        """Final values of the run (rank 0)."""

    def add_config(self, values: Dict[str, Any]) -> None:
        """More of the run's config (its provenance)."""

    def close(self, failed: bool = False, preempted: int = 0) -> None:
        """Flush and close; `failed` / `preempted` (a signal number) say how the run ended."""
