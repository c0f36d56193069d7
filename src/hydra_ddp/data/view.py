"""A rank's view of the data: the policy decides the rows (policies.py), the view loads them,
checks them and makes the loader (`trainer.batch_size` reaches the loader only through here)."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from hydra_ddp.data.datasets import check_loaded
from hydra_ddp.data.policies import build_policy, rank_epoch, rows_in, train_file_rows
from hydra_ddp.data.sources import DataSource
from hydra_ddp.distributed import DistEnv
from hydra_ddp.distributed.preemption import data_worker_init
from hydra_ddp.errors import UserError


class TrainData:
    """The training split as this rank sees it under the sampler policy: `epoch(e, start_batch)`
    iterates epoch e's batches from a given batch on, the same number on every rank
    (`micro_batches_per_epoch`), which DDP needs. `sampler`: the policy, or its config."""

    def __init__(
        self,
        source: DataSource,
        sampler: Any,
        env: DistEnv,
        batch_size: int,
        seed: int,
        num_workers: int = 0,
    ):
        self.source, self.env, self.num_workers = source, env, num_workers
        self.batch_size = batch_size
        self.policy = build_policy(sampler, seed)
        check_sampling(source, self.policy, env.world_size, batch_size)
        self._view(0)
        if len(self.sampler) == 0:
            raise UserError(
                f"trainer.batch_size={batch_size} with sampler.drop_last=true leaves "
                "no full batch per rank: lower trainer.batch_size"
            )

    def _view(self, epoch: int) -> None:
        """The rows the policy gives this rank in `epoch`, loaded and checked, its batches of
        them, and the loader."""
        n, files = self.source.num_rows("train"), train_file_rows(self.source)
        mine, self.sampler = rank_epoch(
            self.policy, n, files, self.env.world_size, self.env.rank, epoch, self.batch_size
        )
        self.dataset = self.source.load("train", mine)
        check_loaded(self.dataset, self.source.spec, "train")
        self.loader = loader(self.source, self.dataset, self.sampler, self.env, self.num_workers)
        self._epoch = epoch

    @property
    def micro_batches_per_epoch(self) -> int:
        return len(self.sampler)

    @property
    def rows_held(self) -> int:
        return len(self.dataset)

    @property
    def rows_per_rank(self) -> int:
        return self.policy.rows_per_rank(self.rows_held, self.env.world_size)

    @property
    def bytes_held(self) -> int:
        return int(getattr(self.dataset, "nbytes", 0))

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator:
        """Batches of `epoch`, skipping the first `start_batch` (resuming mid-epoch)."""
        if self.policy.reloads_each_epoch and self._epoch != epoch:
            self._view(epoch)
        self.sampler.load_state_dict({"epoch": epoch, "start_batch": start_batch})
        return iter(self.loader)


def check_sampling(source: DataSource, sampler: Any, world: int, batch_size: int) -> None:
    """Refuse a policy the training split cannot support, before any data is loaded.
    `sampler`: a policy, or the `sampler` config (built here: a bad argument fails too)."""
    policy = build_policy(sampler, 0)
    policy.check(source.num_rows("train"), train_file_rows(source), world, batch_size)


class EvalData:
    """A held-out split, partitioned so each row is evaluated exactly once across ranks (no
    DistributedSampler padding of rows: ranks may hold one row more or less), in batches that
    line up across ranks (`EvenBatches`). The policy's `eval_rank_ranges` says which rows each
    rank loads."""

    def __init__(
        self,
        source: DataSource,
        split: str,
        sampler: Any,
        env: DistEnv,
        batch_size: int,
        num_workers: int = 0,
    ):
        self.source, self.env, self.num_workers = source, env, num_workers
        n, world, rank = source.num_rows(split), env.world_size, env.rank
        rank_ranges = build_policy(sampler, 0).eval_rank_ranges(n, world)
        if rank_ranges is None:  # every rank loads the split and takes rows rank, rank + world, ...
            counts = [len(range(r, n, world)) for r in range(world)]
            self.dataset = source.load(split, None)
            # The split's row numbers of this rank's rows, and where they are in the dataset.
            self.split_rows = indices = np.arange(rank, n, world, dtype=np.int64)
        else:
            counts = [sum(b - a for a, b in part) for part in rank_ranges]
            # A rank with none of the split's rows still evaluates (padding): one row to show.
            self.dataset = source.load(
                split, rank_ranges[rank] if counts[rank] or not n else [(0, 1)]
            )
            self.split_rows = rows_in(rank_ranges[rank])
            indices = np.arange(counts[rank], dtype=np.int64)
        check_loaded(self.dataset, source.spec, split)
        self.sampler = EvenBatches(indices, counts, rank, batch_size)
        self._loader: DataLoader | None = None

    def padded_ranks(self, i: int) -> tuple[bool, ...]:
        """Per rank, whether its batch i is padding."""
        return self.sampler.padded[i]

    def rows(self) -> Iterator[np.ndarray]:
        """The split's row numbers of each batch `__iter__` yields, in the same order (none for
        a padded batch)."""
        return (self.split_rows[self.sampler.positions(i)] for i in range(len(self.sampler)))

    def __iter__(self) -> Iterator:
        if not len(self.sampler):
            return iter(())
        if self._loader is None:  # made once: its workers persist between evaluations
            self._loader = loader(
                self.source, self.dataset, self.sampler, self.env, self.num_workers
            )
        return iter(self._loader)


def boundaries(counts: list[int], batch_size: int) -> list[tuple[int, int]]:
    """The batches [start, stop) of local row positions every rank walks through: up to the
    largest count, cut at every multiple of `batch_size` and at every rank's count."""
    most = max(counts, default=0)
    cuts = set(range(batch_size, most, batch_size)) | {c for c in counts if 0 < c < most}
    edges = [0, *sorted(cuts), most] if most else [0]
    return list(zip(edges[:-1], edges[1:]))


class EvenBatches:
    """Evaluation batches that line up across ranks, as accelerate's `even_batches` does.

    With uneven shares, ranks would hold different numbers of batches, and a loss or metric that
    gathers would pair one rank's gather with another rank's next collective (gloo aborts, or
    the shapes read back are garbage). Here batch i has the same size on every rank and is, on
    each, all real rows or all padding: padding repeats the rank's own rows and counts for
    nothing (loss, sums, predictions and `gather_for_metrics` leave it out).
    `indices`: the dataset index of each of this rank's real rows; `counts`: every rank's count.
    """

    def __init__(self, indices: np.ndarray, counts: list[int], rank: int, batch_size: int):
        self.indices = np.asarray(indices, dtype=np.int64)
        self.held = counts[rank]
        self.batches = boundaries(counts, batch_size)
        self.padded = [tuple(start >= c for c in counts) for start, _ in self.batches]

    def positions(self, i: int) -> np.ndarray:
        """Local row positions of batch i (of its real rows; none for a padded batch)."""
        start, stop = self.batches[i]
        return np.arange(start, stop) if stop <= self.held else np.arange(0)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[np.ndarray]:
        for start, stop in self.batches:
            if start < self.held:
                yield self.indices[start:stop]
            elif self.held:  # the rank's own rows again, as many as the batch needs
                yield self.indices[np.arange(stop - start) % self.held]
            else:  # a rank with no row of the split: its first loaded row (see EvalData)
                yield np.zeros(stop - start, dtype=np.int64)


def loader(
    source: DataSource, dataset: Dataset, sampler: Any, env: DistEnv, num_workers: int
) -> DataLoader:
    """A DataLoader over `sampler`'s index batches: a whole batch per `dataset[idx]` for array
    sources, `dataset[i]` per item and `collate_fn` for TorchDatasets. Its own generator:
    without one, every iter() draws a seed from the global RNG, so a run resumed mid-epoch (one
    extra iter() after the RNG state is restored) would get other dropout masks than the
    uninterrupted run."""
    common = dict(
        num_workers=num_workers,
        pin_memory=env.device.type == "cuda",
        persistent_workers=num_workers > 0,
        generator=torch.Generator(),
        worker_init_fn=data_worker_init if num_workers > 0 else None,
    )
    if getattr(source, "per_item", False):
        return DataLoader(
            dataset,
            batch_sampler=_IndexLists(sampler),
            collate_fn=getattr(source, "collate_fn", None) or default_collate,
            **common,
        )
    # batch_size=None: the sampler yields whole index arrays and the dataset gathers a batch in
    # one call, so the DataLoader only adds workers and pinning when asked for.
    return DataLoader(dataset, sampler=sampler, batch_size=None, **common)


class _IndexLists:
    """A sampler of index arrays as a DataLoader batch sampler (lists of Python ints)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[int]]:
        return (np.asarray(idx).tolist() for idx in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)
