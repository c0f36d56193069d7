"""Every extension contract of the template, defined once: what your code implements to plug
into the loop without editing it, and on which ranks each method runs.

    DataSource     a data set                    data._target_             conf/data/
    SamplerPolicy  which rows each rank reads    sampler._target_          conf/sampler/
    EpochSampler   one rank's batches per epoch  what a policy returns
    CommHook       DDP gradient communication    ddp.comm_hook._target_    conf/ddp/
    Sink           where stats go                logger.sink._target_      conf/logger/
    Metric         an evaluation number          metrics.<name>._target_   conf/metrics/
    Callback       per-step/epoch/eval work      callbacks.<name>._target_
    Step           the optimizer step            step._target_

Each is a `typing.Protocol`: any class with these methods fits, no base class needed (the
template's bases, e.g. `hydra_ddp.data.DataSource`, only add defaults). A constructor gets its
YAML's arguments and, by parameter name, what the template knows at run time. What a checkpoint
holds is torch's `Stateful` (`state_dict` / `load_state_dict`). docs/extending.md has a
worked example of each. A call marked *collective* must be reached by every
rank at the same point.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, Protocol, runtime_checkable

if TYPE_CHECKING:  # the libraries' types only: every contract is defined in this module
    import numpy as np
    import torch
    from torch.utils.data import Dataset

# Rows of a split as half-open [start, stop) ranges, in order: what a rank loads.
Ranges = list[tuple[int, int]]


class Kind(Enum):
    """What a `Record` carries."""

    stats = "stats"  # this rank's training stats of one log interval, as soon as logged
    interval = "interval"  # the same interval once every rank's stats are gathered
    values = "values"  # a callback's ctx.log values (of `rank`, which may be another rank)
    eval = "eval"  # evaluation metrics keyed like val/acc (rank 0 only)


@dataclass
class Record:
    """One thing a `Sink` is given to record at one step."""

    kind: Kind
    rank: int  # whose values these are
    values: Dict[str, Any]  # stats, ctx.log values or metrics (tracking/sink.py: their types)
    time: float  # time.time() when it was logged
    # Kind.interval: every rank's stats by rank (float) and, on rank 0, the aggregates.
    table: Dict[int, Dict[str, float]] = field(default_factory=dict)
    aggregates: Dict[str, float] = field(default_factory=dict)


@runtime_checkable
class DataSource(Protocol):
    """One data set with "train", "val" and "test" splits. The constructor runs in the launching
    process and on every rank before the process group starts (check shapes there, in one
    line); no method is collective. `load(split, ranges)` reads only the rows in `ranges` (None:
    the whole split) and returns a dataset that an int64 index array turns into one batch
    (`per_item = True`: a map-style dataset a DataLoader batches). Optional: `file_rows(split)`
    and `origin(split)` (`hydra_ddp.data.DataSource` has their defaults)."""

    spec: dict[str, Any]  # what a model's constructor receives by name
    unit: str  # throughput is reported as <unit>_per_s...
    items_per_row: int  # ...counting this many per row

    def num_rows(self, split: str) -> int: ...

    def load(self, split: str, ranges: Ranges | None) -> Dataset: ...


@runtime_checkable
class EpochSampler(Protocol):
    """One rank's batches of row indices (into the rows it loaded), epoch by epoch: the same
    number of batches on every rank (DDP hangs otherwise), deterministic from (seed, epoch,
    rank). The loop owns the position and sets it with `load_state_dict({"epoch": e,
    "start_batch": b})` at each epoch start and on resume."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[np.ndarray]: ...

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class SamplerPolicy(Protocol):
    """Which rows each rank loads and in which order. Every method runs on every rank with the
    same arguments and must give the same answer there (a pure function, no collective).
    `rank_ranges` returns each rank's ranges to load (None: every rank loads the whole split);
    `settings()` (recorded in checkpoints) lets a resume that changes the policy count the rows
    read twice or skipped."""

    name: str
    seed: int | None  # None becomes trainer.seed
    reloads_each_epoch: bool  # rank_ranges is asked again at each epoch start

    # In the launching process, before any data is loaded: a one-line UserError if it cannot work.
    def check(self, num_rows: int, file_rows: list[int], world: int, batch_size: int) -> None: ...

    def rank_ranges(
        self, num_rows: int, file_rows: list[int], world: int, epoch: int
    ) -> list[Ranges] | None: ...

    def sampler(
        self,
        rows_held: int,
        rank_ranges: list[Ranges] | None,
        rank: int,
        world: int,
        batch_size: int,
    ) -> EpochSampler: ...

    # The rows each rank evaluates, every row once over the ranks (None: every rank loads the
    # split and takes positions rank, rank + world, ...).
    def eval_rank_ranges(self, num_rows: int, world: int) -> list[Ranges] | None: ...

    # About how many rows a rank trains on per epoch (warns when a batch is larger).
    def rows_per_rank(self, rows_held: int, world: int) -> int: ...

    def settings(self) -> dict[str, Any] | None: ...


@runtime_checkable
class CommHook(Protocol):
    """How DDP communicates gradients: `hook(state, bucket)` is what
    `DistributedDataParallel.register_comm_hook` calls for each bucket inside the last
    micro-batch's backward, *collective*, its future holding the averaged bucket. Optional:
    `register(ddp)`, `name`, and `state_dict()` / `load_state_dict()` (checkpointed per rank).
    A plain function `(state, bucket) -> Future` is a stateless hook."""

    state: Any

    def hook(self, state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]: ...


@runtime_checkable
class Sink(Protocol):
    """Where a job's records go. Built and closed on *every* rank; a constructor that starts
    collectives must do so on every rank in the same order. `log` is never collective;
    `summary` runs on rank 0; `close` must not raise over the error that made the job close.
    Optional: `gathers_values = True` (rank 0 also gets the other ranks' ctx.log records),
    `run_id` (recorded in the stats files), and a static `check_before_launch(logger_cfg)`,
    called once before any worker starts."""

    def log(self, record: Record, step: int) -> None: ...

    def summary(self, values: dict[str, float]) -> None: ...

    def add_config(self, values: dict[str, Any]) -> None: ...

    # `failed`: the job ends on an error; `preempted`: the signal that stopped it (0: none).
    def close(self, failed: bool = False, preempted: int = 0) -> None: ...


@runtime_checkable
class Metric(Protocol):
    """An evaluation number reported as val/<name> and test/<name>. `sums` runs on every rank
    for each of its batches; the sums are added over batches, then over ranks (one
    all-reduce), so the number is exact however rows are split; `compute` runs on every rank.
    `gathers = True`: `sums` gathers every rank's rows itself (*collective*) and is counted
    once."""

    gathers: bool

    def sums(self, output: Any, target: torch.Tensor) -> torch.Tensor: ...

    def compute(self, totals: list[float]) -> float: ...


class Callback(Protocol):
    """Work of yours at points of the loop: define any subset of the hooks. Each runs on *every*
    rank, in config order, given the loop's `hydra_ddp.callbacks.Context` (a collective inside
    one must run on every rank). Optional: `state_dict()` / `load_state_dict()` (per rank, in
    every checkpoint) and `checkpoint_members()` (more state every checkpoint holds)."""

    def on_train_start(self, ctx: Any) -> None:
        """After the resume, before the first step."""

    def on_before_optimizer_step(self, ctx: Any) -> None:
        """The step's averaged (unscaled) gradients in `.grad`, before clipping and the step."""

    def on_step_end(self, ctx: Any) -> None:
        """After each step; `ctx.batch`, `ctx.outputs` and `ctx.losses` for this call only."""

    def on_eval_end(self, ctx: Any) -> None:
        """After each validation, its metrics in `ctx.metrics`."""

    def on_epoch_end(self, ctx: Any) -> None:
        """Once per epoch that ends (also across a resume in the middle of one)."""

    def on_train_end(self, ctx: Any) -> None:
        """After the final validation and test, their metrics in `ctx.metrics`."""


@runtime_checkable
class Step(Protocol):
    """One optimizer step, called on every rank once per step. `tools` is the loop's
    `hydra_ddp.step.StepTools` (backward with `no_sync()`, unscale, clip, step); the wrapped
    model's forward is *collective*. Returns the mean `loss` and extras as device tensors: no
    `.item()`, which would stall the device each step."""

    def __call__(
        self,
        tools: Any,
        model: torch.nn.Module,
        micro_batches: list[Any],
        objective: Callable[..., Any],
        optimizers: dict[str, torch.optim.Optimizer],
    ) -> dict[str, torch.Tensor]: ...


PROTOCOLS = (DataSource, SamplerPolicy, EpochSampler, CommHook, Sink, Metric, Callback, Step)


def missing_members(obj: Any, protocol: type) -> list[str]:
    """The methods and attributes of `protocol` that `obj` (an instance or a class) lacks, in
    the protocol's order; Callback's hooks are each optional, so none is ever missing."""
    if protocol is Callback:
        return []
    dunders = ("__len__", "__iter__", "__call__")
    names = [n for n in vars(protocol) if not n.startswith("_") or n in dunders]
    names += list(vars(protocol).get("__annotations__", {}))
    return [n for n in dict.fromkeys(names) if not hasattr(obj, n)]
