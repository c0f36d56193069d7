"""The typed logger/ group (conf/logger/*.yaml; config.py re-exports it): where stats go besides
the per-rank JSON-lines files, and how W&B is used."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, List, Optional

from hydra_ddp.errors import check_setting


class Layout(Enum):
    """The three layouts W&B documents for distributed training."""

    gather = "gather"  # rank 0 gathers every rank's stats into one run, keys rank{r}/<stat>
    group = "group"  # one run per rank, grouped by job
    shared = "shared"  # all ranks write one run (W&B shared mode; online only)


class WandbMode(Enum):
    auto = "auto"  # online if logged in or WANDB_API_KEY is set, else offline
    online = "online"
    offline = "offline"
    disabled = "disabled"


class WandbConsole(Enum):
    # The job's log is already in <output dir>/train_rank<r>.log; W&B's copy would re-send
    # every line through its service, which costs the ranks CPU on a busy node.
    off = "off"
    wrap = "wrap"  # W&B's "Logs" tab shows rank 0's console (W&B's own default)
    redirect = "redirect"


@dataclass
class LoggerConfig:
    # Where stats go besides the per-rank JSON-lines files: `_target_` (a class meeting
    # hydra_ddp.protocols.Sink) and its own arguments; null: the files only (logger=none).
    # The keys below are the W&B sink's.
    sink: Optional[Any] = None
    layout: Layout = Layout.gather
    mode: WandbMode = WandbMode.auto
    console: WandbConsole = WandbConsole.off
    project: str = "hydra-ddp"
    entity: Optional[str] = None
    name: Optional[str] = None  # null: the job's name (its overrides in a sweep)
    group: Optional[str] = None  # null: one group per sweep (or per job)
    tags: List[str] = field(default_factory=list)
    # Send a training row to W&B at most once per this many seconds (0: every log interval).
    # The local stats/*.jsonl keep every interval; the last row is always sent. W&B suggests
    # under 100k points per metric and throttles projects that log faster.
    min_interval_s: float = 1.0
    # Seconds W&B may take to reach its server when an online run starts; then the job stops
    # with one line (W&B's own default: 90 s, then a traceback). WANDB_INIT_TIMEOUT overrides.
    init_timeout_s: float = 60.0
    # Seconds the end of a run may wait for W&B's uploads (then the rest is dropped with a
    # warning, and `wandb sync` can send it later); 0: wait as long as it takes.
    finish_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        check_setting(self.init_timeout_s > 0, "logger.init_timeout_s", "> 0", self.init_timeout_s)
        check_setting(
            self.finish_timeout_s >= 0, "logger.finish_timeout_s", ">= 0", self.finish_timeout_s
        )
        check_setting(
            self.min_interval_s >= 0,
            "logger.min_interval_s",
            ">= 0 (0: every interval)",
            self.min_interval_s,
        )
