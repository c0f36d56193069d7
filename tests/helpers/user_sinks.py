"""A user's sink (tests/ is on sys.path), chosen only by `logger.sink._target_`: no edit of the
template. It subclasses nothing (hydra_ddp.protocols.Sink is a protocol), asks for `env` and
`run` by name, takes one option of its own, and writes what it received to
<output dir>/sink_rank<r>.json when closed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class Collect:
    def __init__(self, env: Any, run: Any, label: str = "collected") -> None:
        self.rank, self.label = env.rank, label
        self.path = Path(run.output_dir) / f"sink_rank{env.rank}.json"
        self.records: list[dict[str, Any]] = []
        self.summaries: list[dict[str, float]] = []

    def log(self, record: Any, step: int) -> None:
        self.records.append(
            {
                "kind": record.kind.value,
                "rank": record.rank,
                "step": step,
                "keys": sorted(record.values),
                "table_ranks": sorted(record.table),
                "aggregates": sorted(record.aggregates),
            }
        )

    def summary(self, values: dict[str, float]) -> None:
        self.summaries.append(dict(values))

    def add_config(self, values: dict[str, Any]) -> None:
        pass

    def close(self, failed: bool = False, preempted: int = 0) -> None:
        about = {"label": self.label, "failed": failed, "summaries": self.summaries}
        self.path.write_text(json.dumps({**about, "records": self.records}))


class NotASink:
    """Has no log/close: refused in one line."""

    def __init__(self, env: Any) -> None:
        self.env = env
