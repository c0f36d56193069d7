"""Where the loop is (`Position`, moved only by the loop), the batches from there on
(`batches`), and the position as a checkpoint member (`PositionState`): a resumed run continues
mid-epoch, also with another batch size, world size or sampler."""

from __future__ import annotations

import itertools
import logging
from dataclasses import asdict, dataclass, fields
from typing import Any, Iterator

from hydra_ddp.checkpoint.state import loading_from
from hydra_ddp.config import TrainerConfig
from hydra_ddp.data import TrainData, epoch_rows, split_record

log = logging.getLogger(__name__)


@dataclass
class Position:
    """The one copy, saved in checkpoints."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of this epoch already trained on
    samples_seen: int = 0  # by this rank

    def epochs_done(self, length: int) -> int:
        """Epochs completed (`length`: micro-batches per epoch)."""
        return self.epoch + (1 if self.batch_in_epoch >= length else 0)


def epoch_length(batches: int, tcfg: TrainerConfig) -> int:
    """Micro-batches per epoch and rank, after trainer.overfit_batches / limit_train_batches."""
    if tcfg.overfit_batches:
        return min(tcfg.overfit_batches, batches)
    return min(tcfg.limit_train_batches, batches) if tcfg.limit_train_batches else batches


def batches(data: TrainData, start: Position, tcfg: TrainerConfig) -> Iterator[tuple]:
    """(epoch, batch_in_epoch, batch) from `start` on, forever; batch_in_epoch counts from 1.
    trainer.overfit_batches: the first N batches of epoch 0, every epoch."""
    length = epoch_length(data.micro_batches_per_epoch, tcfg)
    fixed = list(itertools.islice(data.epoch(0), length)) if tcfg.overfit_batches else None
    epoch, done = start.epoch, start.batch_in_epoch
    while True:
        rest = fixed[done:] if fixed else data.epoch(epoch, done)
        for batch in rest:
            if done >= length:
                break
            done += 1
            yield epoch, done, batch
        epoch, done = epoch + 1, 0


@dataclass(kw_only=True)
class Counting:
    """How this job counts the position: what a checkpoint counted otherwise is converted from."""

    world_size: int
    batch_size: int
    sampler: dict[str, Any]  # epoch_rows.settings
    micro_batches_per_epoch: int
    is_main: bool
    source: Any  # the data source (to say which rows a changed sampler reads twice)
    tcfg: TrainerConfig


class PositionState:
    """The checkpoint member `position`: `step`, `epoch`, ... at the checkpoint's top level,
    with the world size, batch size and sampler settings the rows were counted in."""

    def __init__(self, pos: Position, counting: Counting) -> None:
        self.pos, self.counting = pos, counting
        # Which rows are training rows (None: the source does not say): see split_record.py.
        self.split = split_record.recorded_split(counting.source)

    def state_dict(self) -> dict[str, Any]:
        here = self.counting
        split = split_record.saved_form(self.split)
        return {
            **asdict(self.pos),
            "batch_size": here.batch_size,
            "sampler": here.sampler,
            "world_size": here.world_size,
            **({"split": split} if split is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in fields(Position):
            setattr(self.pos, f.name, int(state.get(f.name, 0)))
        self.pos.step = int(state["step"])
        here = self.counting
        saved = epoch_rows.Setup(
            state.get("sampler"),
            int(state.get("world_size") or here.world_size),
            int(state.get("batch_size", 0)) or here.batch_size,  # 0: not recorded, this job's
        )
        continue_epoch(self.pos, here, saved, loading_from())
        if here.is_main:
            split_record.say_changed(loading_from(), state.get("split"), self.split)
        log.info(
            "resumed from %s at step %d (epoch %d, batch %d)",
            loading_from(),
            self.pos.step,
            self.pos.epoch,
            self.pos.batch_in_epoch,
        )


def continue_epoch(pos: Position, here: Counting, saved: epoch_rows.Setup, path: Any) -> None:
    """Continue the epoch from its first unseen row when the checkpoint counted batches of
    another size or over another number of ranks. Rows of an epoch are consumed as a prefix of
    its order, so this is exact when the rows done divide into new batches; else the rest of
    the last partial batch is trained again. The log says how many rows are trained again, or,
    under other sampler settings, read twice or skipped (epoch_rows)."""
    tcfg = here.tcfg
    world, batch_size, done = saved.world_size, saved.batch_size, pos.batch_in_epoch
    # A checkpoint from before the settings were recorded: taken to have this job's.
    saved.settings = saved.settings or here.sampler
    reordered = epoch_rows.reading_order_changed(
        saved.settings, here.sampler, world, here.world_size
    )
    if (world, batch_size) != (here.world_size, here.batch_size):
        rows_done = pos.batch_in_epoch * batch_size * world
        per_batch = here.batch_size * here.world_size
        pos.batch_in_epoch = rows_done // per_batch
        again = rows_done - pos.batch_in_epoch * per_batch
        if not reordered and here.is_main:  # the same on every rank: said once
            log.warning(
                "%s counted batches of %d rows on %d rank(s), this job %d on %d: epoch %d "
                "continues at its row %d (batch %d here)%s",
                path, batch_size, world, here.batch_size, here.world_size, pos.epoch,
                rows_done, pos.batch_in_epoch,
                f"; {again} rows of it are trained again (not a whole batch)" if again
                else ", exactly",
            )  # fmt: skip
    if reordered and here.is_main and not tcfg.overfit_batches:
        now = epoch_rows.Setup(here.sampler, here.world_size, here.batch_size)
        epoch_rows.say_reordered(
            path, saved, now, here.source, pos.epoch, done, pos.batch_in_epoch,
            tcfg.limit_train_batches,
        )  # fmt: skip
    if pos.batch_in_epoch >= here.micro_batches_per_epoch:  # ended this epoch
        pos.epoch, pos.batch_in_epoch = pos.epoch + 1, 0
