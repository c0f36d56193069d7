"""Sampler policies: which rows each rank loads (`rank_ranges`) and in which batches it reads
them (`sampler`), decided once per epoch for every rank at once. Chosen by `sampler._target_`
(`sampler=strided`, `sampler=sharded`, or a YAML of yours); the contract, method by method:
`hydra_ddp.protocols.SamplerPolicy`.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import numpy as np

from hydra_ddp.components import build
from hydra_ddp.data.sampling import EpochSampler, ShardedSampler, StridedSampler, _check_int
from hydra_ddp.errors import UserError, check
from hydra_ddp.protocols import Ranges


class SamplerPolicy:
    """The base of a policy of yours (the contract: `hydra_ddp.protocols.SamplerPolicy`):
    subclass it (or a built-in one) and override `sampler`, and `rank_ranges` if ranks load
    only some rows. `seed` None: trainer.seed (see `build_policy`)."""

    name = "custom"  # what summary.json's `sampler` says
    reloads_each_epoch = False

    def __init__(self, shuffle: bool = True, seed: int | None = None, drop_last: bool = False):
        self.shuffle, self.seed, self.drop_last = bool(shuffle), seed, bool(drop_last)

    def check(self, num_rows: int, file_rows: list[int], world: int, batch_size: int) -> None:
        """Refuse, with a UserError naming the key and what to do, a split this policy cannot
        serve on `world` ranks."""

    def rank_ranges(
        self, num_rows: int, file_rows: list[int], world: int, epoch: int
    ) -> list[Ranges] | None:
        return None  # every rank loads the whole split

    def sampler(
        self,
        rows_held: int,
        rank_ranges: list[Ranges] | None,
        rank: int,
        world: int,
        batch_size: int,
    ) -> EpochSampler:
        raise NotImplementedError(f"{type(self).__qualname__} must define sampler()")

    def eval_rank_ranges(self, num_rows: int, world: int) -> list[Ranges] | None:
        return partition_rows(num_rows, world)

    def rows_per_rank(self, rows_held: int, world: int) -> int:
        return rows_held

    def settings(self) -> dict[str, Any] | None:
        return None


class Strided(SamplerPolicy):
    """Every rank holds the whole split and takes positions rank, rank + world, ... of a
    per-epoch permutation shared by all ranks (DistributedSampler's semantics)."""

    name = "strided"

    # No defaults here: conf/sampler/strided.yaml holds them (one place).
    def __init__(self, shuffle: bool, seed: int | None, drop_last: bool):
        super().__init__(shuffle, seed, drop_last)

    def check(self, num_rows: int, file_rows: list[int], world: int, batch_size: int) -> None:
        if self.drop_last and num_rows < world:
            raise UserError(
                f"sampler.drop_last=true needs at least one training row per rank: "
                f"{num_rows} rows for {world} ranks; use fewer processes"
            )

    def sampler(
        self,
        rows_held: int,
        rank_ranges: list[Ranges] | None,
        rank: int,
        world: int,
        batch_size: int,
    ) -> EpochSampler:
        return StridedSampler(
            rows_held, rank, world, batch_size,
            shuffle=self.shuffle, seed=int(self.seed or 0), drop_last=self.drop_last,
        )  # fmt: skip

    def eval_rank_ranges(self, num_rows: int, world: int) -> list[Ranges] | None:
        return None

    def rows_per_rank(self, rows_held: int, world: int) -> int:
        return rows_held // world

    def settings(self) -> dict[str, Any] | None:
        # Sharded's keys too (unused here), so that checkpoints of either compare key by key.
        return {
            "policy": "strided", "shuffle": self.shuffle, "seed": self.seed,
            "drop_last": self.drop_last, "shard_by": "rows", "rotate": False,
        }  # fmt: skip


class Sharded(SamplerPolicy):
    """Every rank loads only its own part (contiguous rows, or whole files with
    shard_by=files) and shuffles it locally; all ranks take min-over-ranks rows per epoch.
    rotate: a different part for each rank every epoch."""

    name = "sharded"

    def __init__(
        self,
        shuffle: bool,
        seed: int | None,
        drop_last: bool,
        shard_by: str,
        rotate: bool,
    ):  # no defaults: conf/sampler/sharded.yaml holds them
        check(shard_by in ("rows", "files"), "shard_by", "rows or files", shard_by)
        super().__init__(shuffle, seed, drop_last)
        self.shard_by, self.rotate = str(shard_by), bool(rotate)
        self.reloads_each_epoch = self.rotate

    def check(self, num_rows: int, file_rows: list[int], world: int, batch_size: int) -> None:
        if num_rows < world:
            raise UserError(
                f"sampler=sharded needs at least one training row per rank: the training "
                f"split has {num_rows} rows for {world} ranks; use fewer processes or "
                "sampler=strided"
            )
        if self.shard_by == "files" and len(file_rows) < world:
            raise UserError(
                f"sampler.shard_by=files needs at least one file per rank: {len(file_rows)} "
                f"file(s) for {world} ranks; use sampler.shard_by=rows or write more "
                "shards (scripts/make_synthetic.py --shards)"
            )
        if self.drop_last and num_rows // world < batch_size:
            raise UserError(
                f"sampler=sharded with drop_last=true: each rank holds about {num_rows // world} "
                f"rows, fewer than trainer.batch_size={batch_size}; lower trainer.batch_size"
            )

    def rank_ranges(
        self, num_rows: int, file_rows: list[int], world: int, epoch: int
    ) -> list[Ranges] | None:
        if self.shard_by == "files":
            return partition_files(file_rows, world, epoch, self.rotate)
        return partition_rows(num_rows, world, epoch, self.rotate)

    def sampler(
        self,
        rows_held: int,
        rank_ranges: list[Ranges] | None,
        rank: int,
        world: int,
        batch_size: int,
    ) -> EpochSampler:
        assert rank_ranges is not None
        return ShardedSampler(
            rows_held, samples_per_epoch(rank_ranges), rank, batch_size,
            shuffle=self.shuffle, seed=int(self.seed or 0), drop_last=self.drop_last,
        )  # fmt: skip

    def settings(self) -> dict[str, Any] | None:
        return {
            "policy": "sharded", "shuffle": self.shuffle, "seed": self.seed,
            "drop_last": self.drop_last, "shard_by": self.shard_by, "rotate": self.rotate,
        }  # fmt: skip


BUILT_IN = {"strided": Strided, "sharded": Sharded}


def build_policy(sampler: Any, seed: int) -> SamplerPolicy:
    """The policy `sampler` names: a policy object as it is, or the `sampler` config (its
    `_target_` and arguments) built; a seed of None becomes `seed` (trainer.seed)."""
    if isinstance(sampler, Mapping):
        sampler = build(sampler, "sampler")
    if not callable(getattr(sampler, "sampler", None)):
        raise UserError(
            f"sampler._target_ built a {type(sampler).__qualname__}, not a sampler policy: "
            "subclass hydra_ddp.data.policies.SamplerPolicy (the contract: "
            "hydra_ddp.protocols.SamplerPolicy)"
        )
    # The methods' old names: a policy still defining them would be read as loading every row.
    old = [f"{n}()" for n in ("parts", "eval_parts") if callable(getattr(sampler, n, None))]
    if old:
        raise UserError(
            f"sampler._target_ {type(sampler).__qualname__} defines {' and '.join(old)}: these "
            "are now rank_ranges() and eval_rank_ranges(); rename them (same arguments)"
        )
    if getattr(sampler, "seed", None) is None:
        sampler.seed = seed
    return sampler


def from_settings(settings: dict[str, Any]) -> SamplerPolicy:
    """The policy a checkpoint's recorded settings describe (for the resume arithmetic)."""
    if settings.get("policy") in BUILT_IN:
        kind = BUILT_IN[settings["policy"]]
        return kind(**{k: settings[k] for k in inspect.signature(kind).parameters})
    return build(settings, "sampler")


def partition_rows(
    num_rows: int, world_size: int, epoch: int = 0, rotate: bool = False
) -> list[Ranges]:
    """Contiguous parts of ``range(num_rows)``, one per rank: part j is ``[j*n//W, (j+1)*n//W)``
    and rank r holds part r, or part ``(r + epoch) % W`` when ``rotate`` (an empty list when
    ``num_rows < world_size`` leaves it none)."""
    n = _check_int("num_rows", num_rows, 1)
    w = _check_int("world_size", world_size, 1)
    epoch = _check_int("epoch", epoch, 0)
    result: list[Ranges] = []
    for rank in range(w):
        part = (rank + epoch) % w if rotate else rank
        start, stop = part * n // w, (part + 1) * n // w
        result.append([(start, stop)] if stop > start else [])
    return result


def partition_files(
    file_rows: list[int], world_size: int, epoch: int = 0, rotate: bool = False
) -> list[Ranges]:
    """Whole shard files per rank, round-robin, as global row ranges in file order: file f goes
    to rank ``f % W``, or ``(f - epoch) % W`` when ``rotate`` (every rank's set then changes
    every epoch, and each file is held by exactly one rank per epoch)."""
    w = _check_int("world_size", world_size, 1)
    epoch = _check_int("epoch", epoch, 0)
    rows = [_check_int(f"file_rows[{i}]", r, 0) for i, r in enumerate(file_rows)]
    if len(rows) < w:
        raise ValueError(
            f"partition_files needs at least one file per rank: got {len(rows)} files for "
            f"world_size={w}; write more (smaller) shard files or use partition_rows"
        )
    result: list[Ranges] = [[] for _ in range(w)]
    offset = 0
    for f, count in enumerate(rows):
        rank = (f - epoch) % w if rotate else f % w
        if count:
            result[rank].append((offset, offset + count))
        offset += count
    return result


def samples_per_epoch(rank_ranges: list[Ranges]) -> int:
    """Min over ranks of the rows each holds: the number every rank uses per epoch."""
    return min(sum(stop - start for start, stop in ranges) for ranges in rank_ranges)


def rank_epoch(
    policy: SamplerPolicy, num_rows: int, file_rows: list[int], world: int, rank: int,
    epoch: int, batch_size: int,
) -> tuple[Ranges | None, EpochSampler]:  # fmt: skip
    """Rank `rank`'s rows of the training split in `epoch` (None: all of them) and its sampler
    over them: what its loader reads, and what a resume counts rows read twice by."""
    rank_ranges = policy.rank_ranges(num_rows, file_rows, world, epoch)
    mine = None if rank_ranges is None else rank_ranges[rank]
    held = num_rows if mine is None else sum(b - a for a, b in mine)
    return mine, policy.sampler(held, rank_ranges, rank, world, batch_size)


def rows_in(ranges: Ranges) -> np.ndarray:
    parts = [np.arange(a, b, dtype=np.int64) for a, b in ranges]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def train_file_rows(source: Any) -> list[int]:
    # A DataSource of the user's may lack file_rows (only sampler.shard_by=files needs it).
    if hasattr(source, "file_rows"):
        return source.file_rows("train")
    return [source.num_rows("train")]
