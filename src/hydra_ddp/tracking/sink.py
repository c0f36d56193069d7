"""What every sink gets: the records of one job, and `Sink`, a base with no-op defaults.

The contract a sink meets (what each method gets, when, on which ranks) is
`hydra_ddp.protocols.Sink`; the tracker (tracker.py) hands each record to every sink of the job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List

from hydra_ddp.protocols import Kind, Record

__all__ = ["Kind", "Record", "RunInfo", "Sink"]


@dataclass
class RunInfo:
    """What the tracker needs to know about the job it records."""

    output_dir: Path  # the job's output dir, shared by all ranks
    job_name: str  # e.g. "model=cnn,sampler=sharded" in a sweep, or "train"
    group: str  # one per sweep (or per job when not sweeping)
    config: dict  # the resolved config as plain containers (the run's W&B config)
    overrides: List[str] = field(default_factory=list)  # the job's command-line overrides
    # A sweep's job: each key its sweep varies, with this job's value (a secret's blanked).
    swept: Dict[str, Any] = field(default_factory=dict)


class Sink:
    """A place records go to (the contract: `hydra_ddp.protocols.Sink`). Subclasses override
    what they use; `log` has no default."""

    def log(self, record: Record, step: int) -> None:
        raise NotImplementedError

    def summary(self, values: Dict[str, float]) -> None:
        """Final values of the run (rank 0)."""

    def add_config(self, values: Dict[str, Any]) -> None:
        """More of the run's config (its provenance)."""

    def close(self, failed: bool = False, preempted: int = 0) -> None:
        """Flush and close; `failed` / `preempted` (a signal number) say how the run ended."""
