"""The TensorBoard sink (``logger=tensorboard``), one event-file folder per rank: docs/extending.md.
A resumed job purges the steps past its checkpoint from the view (SummaryWriter's purge_step).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional

from torch.utils.tensorboard import SummaryWriter

from hydra_ddp.disk import write_advice
from hydra_ddp.distributed import DistEnv
from hydra_ddp.errors import UserError
from hydra_ddp.tracking.sink import Kind, Record, RunInfo, Sink, is_media


class TensorBoardSink(Sink):
    def __init__(self, env: DistEnv, run: RunInfo, resumed_step: Optional[int]) -> None:
        """Not collective: each rank opens its own folder."""
        self.rank = env.rank
        folder = Path(run.output_dir) / "tensorboard" / f"rank{env.rank}"
        purge = None if resumed_step is None else resumed_step + 1
        for path in (folder.parent, folder):  # else NotADirectoryError from SummaryWriter
            if path.exists() and not path.is_dir():
                raise UserError(
                    f"logger=tensorboard: {path} exists but is not a directory, so no event "
                    "file can be written there: move it away, or logger=none"
                )
        try:  # SummaryWriter's thread would print a read-only dir's error as a traceback
            folder.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=folder).close()
            self.writer: Optional[SummaryWriter] = SummaryWriter(str(folder), purge_step=purge)
        except OSError as e:
            raise UserError(
                f"logger=tensorboard: cannot write to {folder} ({e.strerror}): "
                f"{write_advice(e.errno)}, or logger=none"
            ) from e

    def log(self, record: Record, step: int) -> None:
        writer = self.writer
        if writer is None or record.rank != self.rank:
            return
        if record.kind in (Kind.stats, Kind.values):
            for key, value in record.values.items():
                if isinstance(value, str):
                    writer.add_text(f"train/{key}", value, step)
                elif not is_media(value):
                    writer.add_scalar(f"train/{key}", float(value), step, walltime=record.time)
        elif record.kind == Kind.interval:
            for key, value in record.aggregates.items():
                writer.add_scalar(f"agg/{key}", value, step, walltime=record.time)
        elif record.kind == Kind.eval:
            for key, value in record.values.items():
                writer.add_scalar(key, value, step, walltime=record.time)

    def close(self, failed: bool = False, preempted: int = 0) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()
