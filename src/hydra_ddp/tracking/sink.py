"""What every sink gets: `RunInfo`, the records of one job, `Sink` (a base with no-op defaults;
the contract is `hydra_ddp.protocols.Sink`), and the rule for what `ctx.log` accepts, the same
for every sink (docs/extending.md, "Callback"): numbers, one-element tensors and text; W&B
media for W&B only (the stats file records a placeholder); anything else, or a key the template
logs itself, is refused with a one-line ValueError.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional

import torch

from hydra_ddp.protocols import Kind, Record
from hydra_ddp.tracking import names

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
    sweep_dir: Optional[Path] = None  # a sweep's job: its sweep's dir (a re-run resumes it)


class Sink:
    """A place records go to; subclasses override what they use (`log` has no default)."""

    def log(self, record: Record, step: int) -> None:
        raise NotImplementedError

    def summary(self, values: Dict[str, float]) -> None:
        pass

    def add_config(self, values: Dict[str, Any]) -> None:
        pass

    def close(self, failed: bool = False, preempted: int = 0) -> None:
        pass


def is_media(value: Any) -> bool:
    """A W&B object (wandb.Image, ...), recognised without importing W&B."""
    return type(value).__module__.split(".")[0] == "wandb"


def loggable_values(values: Mapping[str, Any], logged: Iterable[str]) -> Dict[str, Any]:
    """`values` as the sinks take them: scalars as float or int, text, W&B media."""
    seen = set(logged)
    out: Dict[str, Any] = {}
    for key, value in values.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"ctx.log keys are non-empty strings, not {key!r}")
        if names.is_reserved(key, seen):
            raise ValueError(
                f"ctx.log key {key!r} is a field or stat the template logs itself (step, "
                "rank, loss, lr, step_time, ...): give your value another name"
            )
        out[key] = _scalar_or_text(key, value)
    return out


def _scalar_or_text(key: str, value: Any) -> Any:
    if isinstance(value, (str, bool, int)) or is_media(value):
        return value
    if isinstance(value, numbers.Real):
        return float(value)
    if torch.is_tensor(value) and value.numel() == 1:
        return value.item()
    if type(value).__module__ == "numpy" and getattr(value, "size", None) == 1:
        return value.item()
    what = (
        f"a tensor of {value.numel()} elements" if torch.is_tensor(value) else type(value).__name__
    )
    raise ValueError(
        f"ctx.log value {key!r} is {what}: log a number, a one-element tensor, a string or a "
        "W&B media object (wandb.Image, wandb.Histogram, ...)"
    )


def plain(value: Any) -> Any:
    """The value as the stats file records it: W&B media as a placeholder."""
    return f"<wandb.{type(value).__name__}>" if is_media(value) else value
