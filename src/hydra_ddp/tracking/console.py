"""What a person sees on the terminal: rank 0's config tree, progress bar and final summary.

Other ranks stay quiet on the console (their logs still go to their own files) so N ranks do
not print N copies of every line.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path
from typing import Any, Iterator

from rich.console import Console as RichConsole
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.tree import Tree

from hydra_ddp.distributed import DistEnv
from hydra_ddp.tracking import names

log = logging.getLogger(__name__)


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


class Console:
    def __init__(self, env: DistEnv, enabled: bool = True):
        self.env, self.enabled = env, enabled
        self.rich = RichConsole(stderr=True)

    def quiet_other_ranks(self) -> None:
        """Raise the console handlers of non-zero ranks to WARNING; file handlers keep all."""
        if self.env.is_main:
            return
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(
                handler, logging.FileHandler
            ):
                handler.setLevel(logging.WARNING)

    @contextlib.contextmanager
    def said_by_main(self, logger: str) -> Iterator[None]:
        """Within: what `logger` warns (below ERROR) is said by rank 0 only: every rank meets
        the same files (a damaged checkpoint skipped, say), and one line is enough."""
        if self.env.is_main:
            yield
            return
        target = logging.getLogger(logger)
        target.addFilter(_errors_only)
        try:
            yield
        finally:
            target.removeFilter(_errors_only)

    def info_main(self, msg: str, *args: Any) -> None:
        if self.env.is_main:
            log.info(msg, *args)

    def show_config(self, config: dict[str, Any]) -> None:
        if not self.env.is_main:
            return
        tree = Tree("[bold]config[/]")
        for key, value in config.items():
            _add(tree, key, value)
        self.rich.print(tree)

    def progress(self, total: int, done: int) -> Progress:
        """A started progress bar of one task: shown on a terminal of rank 0, elsewhere
        disabled (the log lines suffice)."""
        bar = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.rich,
            disable=not (self.enabled and self.env.is_main and sys.stderr.isatty()),
        )
        bar.add_task("", total=total, completed=done)
        bar.start()
        return bar

    def log_step(
        self,
        step: int,
        total: int,
        stats: dict[str, float],
        last_aggregate: tuple[int, dict[str, float]],
        unit: str,
    ) -> None:
        """One line per log interval (nanoGPT-style), with the slowest rank when there are
        several, from the newest gathered interval (`Tracker.last_aggregate`)."""
        agg_step, agg = last_aggregate
        # One learning rate is shown; several (lr/<optimizer>/<group>) are in the stats files.
        lr = f" | lr {stats[names.LR]:.2e}" if names.LR in stats else ""
        line = (
            f"step {step}/{total} | loss {stats[names.LOSS]:.4f}{lr} | "
            f"{unit}/s {stats[names.throughput(unit)]:.0f} (rank 0) | "
            f"step {1000 * stats[names.STEP_TIME]:.1f} ms | data wait "
            f"{1000 * stats[names.DATA_WAIT]:.2f} ms"
        )
        slowest_ms = agg.get(names.spread(names.STEP_TIME, "max"))
        if self.env.world_size > 1 and slowest_ms is not None:
            line += (
                f" | slowest rank {int(agg[names.SLOWEST_RANK])} "
                f"({1000 * slowest_ms:.1f} ms to step {agg_step})"
            )
        log.info(line)

    def show_summary(self, summary: dict[str, Any], output_dir: Path) -> None:
        if not self.env.is_main:
            return
        keys = [
            "world_size",
            "steps",
            "train_loss",
            *(k for k in summary if k.startswith(("val_", "test_"))),
            *(k for k in summary if k.endswith("_per_s")),
            "wall_time_s",
        ]
        parts = [f"{k} {_short(summary[k])}" for k in keys if k in summary]
        log.info("done | %s | %s", " | ".join(parts), output_dir / "summary.json")


def _short(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _add(tree: Tree, key: str, value: Any) -> None:
    if isinstance(value, dict):
        branch = tree.add(f"[bold]{key}[/]")
        for k, v in value.items():
            _add(branch, k, v)
    else:
        tree.add(f"{key}: {value}")
