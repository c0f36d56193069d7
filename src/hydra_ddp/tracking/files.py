"""The sink that is always there: JSON lines under ``<output_dir>/stats/``: every rank's stats
and ``ctx.log`` values in ``rank{r}.jsonl``; rank 0's aggregates in ``aggregate.jsonl``, its
evaluations in ``eval.jsonl`` and the final values in ``summary.json``; what a resume and
trainer.resume=never do to them: docs/tracking.md.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any, Dict, Optional, TextIO

from hydra_ddp.disk import before, check_regular, open_regular, read_regular
from hydra_ddp.distributed import DistEnv
from hydra_ddp.rundir import jsonfile
from hydra_ddp.tracking import names
from hydra_ddp.tracking.sink import Kind, Record, Sink, plain

logger = logging.getLogger(__name__)

SUPERSEDED = "superseded"  # stats/superseded/: rows a resumed job trained again
# Records start with their step (see JsonFiles._write): found without a full parse.
STEP_FIELD = re.compile(r'^\{"step": (-?\d+)[,}]')
_FIX = "remove it, or move it away (the job appends its stats there, a regular file)"


def set_aside_stats(output_dir: Path) -> Optional[Path]:
    """trainer.resume=never in a used dir: move its stats/ to stats.before-<n>/ and its
    summary.json into that folder, as the checkpoints are set aside. Rank 0, before any rank
    opens a stats file."""
    folder, summary = Path(output_dir) / "stats", Path(output_dir) / "summary.json"
    if not summary.is_file() and not (folder.is_dir() and any(folder.iterdir())):
        return None
    aside = before(folder)
    if folder.is_dir():
        folder.rename(aside)
    aside.mkdir(exist_ok=True)
    if summary.is_file():
        summary.rename(aside / "job_summary.json")
    logger.warning(
        "trainer.resume=never: the stats and summary already in %s were moved to %s",
        output_dir,
        aside,
    )
    return aside


def drop_rows_after(path: Path, step: int) -> int:
    """Move the rows of `path` past `step` to stats/superseded/<name>; returns how many."""
    try:
        lines = read_regular(path, what="stats file", fix=_FIX).splitlines(keepends=True)
    except FileNotFoundError:
        return 0
    keep, later = [], []
    for line in lines:
        found = STEP_FIELD.match(line)
        (later if found and int(found.group(1)) > step else keep).append(line)
    if not later:
        return 0
    aside = path.parent / SUPERSEDED / path.name
    aside.parent.mkdir(exist_ok=True)
    with open_regular(aside, "a", what="stats file", fix=_FIX, encoding="utf-8") as handle:
        handle.writelines(line if line.endswith("\n") else line + "\n" for line in later)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(keep), encoding="utf-8")
    tmp.replace(path)
    return len(later)


def append_to(path: Path) -> TextIO:
    """Open a JSON-lines file to append to, first dropping a last line that a crash cut short
    (appending to it would make both it and the next record unreadable); anything but a regular
    file is refused in one line (opening a FIFO waits for ever)."""
    check_regular(path, "stats file", _FIX)
    if path.is_file():
        with open(path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                keep = data.rfind(b"\n") + 1
                f.truncate(keep)
                logger.warning(
                    "%s ended in a partial record (%d bytes, cut short by a crash): dropped",
                    path,
                    len(data) - keep,
                )
    return open(path, "a", encoding="utf-8")


class JsonFiles(Sink):
    def __init__(self, output_dir: Path, env: DistEnv, resumed_step: Optional[int]):
        self.rank, self.is_main = env.rank, env.is_main
        self.run_id: Optional[str] = None  # set by the W&B sink: tags every row
        self.dir = Path(output_dir) / "stats"
        self.dir.mkdir(parents=True, exist_ok=True)
        own = self.dir / f"rank{env.rank}.jsonl"
        mine = [own]
        if env.is_main:
            # Rank 0 also trims the files of ranks a smaller job no longer has.
            gone = [
                p
                for p in self.dir.glob("rank*.jsonl")
                if p.stem[4:].isdigit() and int(p.stem[4:]) >= env.world_size
            ]
            mine += [self.dir / "aggregate.jsonl", self.dir / "eval.jsonl", *gone]
        if resumed_step is not None:
            dropped = {p.name: drop_rows_after(p, resumed_step) for p in mine}
            if any(dropped.values()):
                logger.info(
                    "resumed at step %d: rows past it moved to %s (%s)",
                    resumed_step,
                    self.dir / SUPERSEDED,
                    ", ".join(f"{k}: {v}" for k, v in dropped.items() if v),
                )
        self.handles: Dict[str, Optional[TextIO]] = {"own": None, "aggregate": None, "eval": None}
        # Append: a resumed job continues the same files.
        self.handles["own"] = append_to(own)
        if env.is_main:
            self.handles["aggregate"] = append_to(mine[1])

    def log(self, record: Record, step: int) -> None:
        head: Dict[str, Any] = {names.STEP: step, names.TIME: record.time}
        if record.kind in (Kind.stats, Kind.values) and record.rank == self.rank:
            values = {k: plain(v) for k, v in record.values.items()}
            self._write("own", {**head, names.RANK: self.rank, **values})
        elif record.kind == Kind.interval and self.is_main:
            self._write("aggregate", {**head, **record.aggregates})
        elif record.kind == Kind.eval and self.is_main:
            if self.handles["eval"] is None:
                self.handles["eval"] = append_to(self.dir / "eval.jsonl")
            self._write("eval", {**head, **record.values})

    def summary(self, values: Dict[str, float]) -> None:
        path = self.dir / "summary.json"
        merged = jsonfile.read(path)
        if merged is None and path.exists():
            logger.warning("could not read %s; rewriting it", path)
        merged = {**(merged or {}), **{k: float(v) for k, v in values.items()}}
        jsonfile.write(path, dict(sorted(merged.items())))

    def close(self, failed: bool = False, preempted: int = 0) -> None:
        for key, handle in self.handles.items():
            self.handles[key] = None
            if handle is not None:
                handle.close()

    def _write(self, key: str, record: Dict[str, Any]) -> None:
        handle = self.handles[key]
        if handle is None:
            return
        if self.run_id is not None:
            record[names.RUN] = self.run_id
        clean = {k: _number(v) for k, v in record.items()}
        handle.write(json.dumps(clean, allow_nan=False) + "\n")
        handle.flush()  # a crashed or killed rank still leaves its stats up to the last interval


def _number(value: Any) -> Any:
    """A stats value as JSON: NaN and infinities as the strings "nan", "inf" and "-inf" (JSON
    has no such numbers; null would not tell them apart), read back by float()."""
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value
