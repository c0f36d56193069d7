"""Which rows of an epoch a sampler setting reads: what a resume that changes the sampler
(strided <-> sharded, its shuffle, seed, drop_last, shard_by, rotate) reads twice or skips.

A checkpoint records the sampler settings it was trained with (`settings`). On resume the rows
already read in the epoch in progress, under the old settings on the old ranks, are compared
with the rows the new settings still read in it: the log says how many rows of the epoch are
read twice and how many skipped, or that there are none. Rows are global row numbers of the
training split (a sharded rank's local row i is the i-th row of its row ranges).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hydra_ddp.data.policies import (
    BUILT_IN,
    build_policy,
    from_settings,
    rank_epoch,
    rows_in,
    train_file_rows,
)

log = logging.getLogger(__name__)

# Above this many training rows the counts are not computed (a few bytes of memory per row).
MAX_ROWS_COUNTED = 200_000_000


def settings(sampler: Any, seed: int) -> dict[str, Any]:
    """What a checkpoint records of the sampler (the policy or its config): the settings that
    decide an epoch's order. A policy that declares none is recorded by its class name and
    `undeclared` (a resume mid-epoch then says it cannot count)."""
    policy = build_policy(sampler, seed)
    declared = policy.settings()
    if declared is None:
        kind = type(policy)
        return {"policy": f"{kind.__module__}.{kind.__qualname__}", "undeclared": True}
    return declared


def _relevant(saved: dict[str, Any]) -> dict[str, Any]:
    """The settings the order depends on (the seed only when shuffling; the sharding only
    under sampler=sharded). A policy of yours: everything it declares."""
    if saved.get("policy") not in BUILT_IN:
        return saved
    keys = ["policy", "shuffle", "drop_last"] + (["seed"] if saved.get("shuffle") else [])
    if saved.get("policy") == "sharded":
        keys += ["shard_by", "rotate"]
    return {k: saved.get(k) for k in keys}


def reading_order_changed(
    old: dict[str, Any], new: dict[str, Any], old_world: int, new_world: int
) -> bool:
    """Whether the rest of the epoch is read by another rule than its start: other settings,
    or another number of ranks under any policy but strided (which keeps its order then). A
    policy that declares no settings: always (it cannot be told)."""
    if old.get("undeclared") or new.get("undeclared"):
        return True
    strided = old.get("policy") == new.get("policy") == "strided"
    return _relevant(old) != _relevant(new) or (not strided and old_world != new_world)


@dataclass
class Setup:
    """One way of reading the training split: the settings, ranks and batch size."""

    settings: dict[str, Any]
    world_size: int
    batch_size: int


def rows_read(
    setup: Setup, num_rows: int, file_rows: list[int], epoch: int, first: int, stop: int
) -> np.ndarray:
    """Whether each global row is read by batches [first, stop) of `epoch`, on any rank."""
    read, policy = np.zeros(num_rows, dtype=bool), from_settings(setup.settings)
    for rank in range(setup.world_size):
        mine, sampler = rank_epoch(
            policy, num_rows, file_rows, setup.world_size, rank, epoch, setup.batch_size
        )
        stop_here = min(stop, len(sampler))
        if stop_here > first:
            order = sampler.indices(epoch)[first * setup.batch_size : stop_here * setup.batch_size]
            read[order if mine is None else rows_in(mine)[order]] = True
    return read


def batches_per_epoch(setup: Setup, num_rows: int, file_rows: list[int], limit: int) -> int:
    """Batches per epoch and rank (the same on every rank), at most `limit` (0: no limit)."""
    policy, world = from_settings(setup.settings), setup.world_size
    batches = len(rank_epoch(policy, num_rows, file_rows, world, 0, 0, setup.batch_size)[1])
    return min(batches, limit) if limit else batches


def twice_and_skipped(
    old: Setup, new: Setup, num_rows: int, file_rows: list[int], epoch: int, done: int,
    start: int, limit: int = 0,
) -> tuple[int, int]:  # fmt: skip
    """Rows of `epoch` read twice and rows skipped when `done` batches of it were read under
    `old` and `new` reads it from its batch `start` to its end (`limit`: batches per epoch at
    most). Read twice: rows read before that the rest reads again. Skipped: rows a whole epoch
    of `new` reads that neither part reads."""
    before = rows_read(old, num_rows, file_rows, epoch, 0, done)
    length = batches_per_epoch(new, num_rows, file_rows, limit)
    after = rows_read(new, num_rows, file_rows, epoch, start, length)
    whole = rows_read(new, num_rows, file_rows, epoch, 0, length)
    return int(np.sum(before & after)), int(np.sum(whole & ~before & ~after))


def say_reordered(
    path: Path, old: Setup, new: Setup, source: Any, epoch: int, done: int, start: int,
    limit: int,
) -> None:  # fmt: skip
    """One log line for a resume from `path` (`done` batches of `epoch` read under `old`) that
    reads the rest of the epoch under `new` from its batch `start`: how many of its rows are
    read twice and skipped, or that each is read once. Nothing when the epoch was over."""
    num_rows, file_rows = source.num_rows("train"), train_file_rows(source)
    undeclared = [s["policy"] for s in (old.settings, new.settings) if s.get("undeclared")]
    if undeclared and done:
        log.warning(
            "%s: the sampler policy %s declares no settings(), so which rows of epoch %d the "
            "resume reads twice or skips cannot be counted (any may be); return "
            "{'_target_': ..., **its arguments} from its settings() to count them",
            path, undeclared[0], epoch,
        )  # fmt: skip
        return
    if not 0 < done < batches_per_epoch(old, num_rows, file_rows, limit):
        return  # nothing read yet, or the whole epoch: the next one starts in the new order
    was = ", ".join(
        f"sampler{'' if k == 'policy' else '.' + k}={v}"
        for k, v in old.settings.items()
        if new.settings.get(k) != v
    )
    # A policy of yours records the `_target_` it is built from (settings()'s documented form).
    named = new.settings.get("policy") or new.settings.get("_target_") or "custom"
    head = (
        f"{path} was trained on {old.world_size} rank(s) with {was or 'these sampler settings'}"
        f", this job has {new.world_size} rank(s) and sampler={named}: the "
        f"rest of epoch {epoch} (from its batch {start}) is read in another order"
    )
    if num_rows > MAX_ROWS_COUNTED:
        log.warning("%s; rows may be read twice or skipped (not counted: %d rows)", head, num_rows)
        return
    twice, skipped = twice_and_skipped(old, new, num_rows, file_rows, epoch, done, start, limit)
    if twice or skipped:
        log.warning(
            "%s: %d rows of the epoch are read twice and %d skipped; resume with the "
            "checkpoint's sampler settings to continue exactly",
            head, twice, skipped,
        )  # fmt: skip
    else:
        log.info("%s, and every row of it is still read once: exact", head)
