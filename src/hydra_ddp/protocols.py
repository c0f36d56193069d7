"""Every extension contract of the template, defined once: what your code implements to plug
into the loop without editing it, what the loop promises in return, and on which ranks.

    DataSource     a data set                    data._target_             conf/data/
    SamplerPolicy  which rows each rank reads    sampler._target_          conf/sampler/
    EpochSampler   one rank's batches per epoch  what a policy returns
    CommHook       DDP gradient communication    ddp.comm_hook._target_    conf/ddp/
    Sink           where stats go                logger.sink._target_      conf/logger/
    Metric         an evaluation number          metrics.<name>._target_   conf/metrics/
    Callback       per-step/epoch/eval work      callbacks.<name>._target_
    HookContext    what a callback's hook gets   (the loop's callbacks.Context)
    Step           the optimizer step            step._target_
    StepHelpers    what a step gets as `tools`   (the loop's step.StepTools)
    Stateful       what a checkpoint can hold    state_dict / load_state_dict
    Member         one entry of a checkpoint     checkpoint/state.py

Each is a `typing.Protocol`: any class with these methods fits, no base class needed (the
template's base classes, e.g. `hydra_ddp.data.DataSource` or `hydra_ddp.tracking.Sink`, only add
defaults). The `runtime_checkable` ones can be checked with `isinstance`. Components are built
with `hydra_ddp.components.build`: a constructor gets its YAML's arguments and, by parameter
name, what the template knows at run time (named in each contract). Worked examples:
docs/extending.md. A call marked *collective* must be reached by every rank at the same point.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Iterator,
    Mapping,
    Protocol,
    runtime_checkable,
)

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


class HookContext(Protocol):
    """What a `Callback`'s hook is given (hydra_ddp.callbacks.Context is the loop's): where the
    loop is, the unwrapped model, and `log` to add values to this rank's stats."""

    rank: int
    world_size: int
    model: torch.nn.Module
    output_dir: Path
    step: int  # optimizer steps taken
    epoch: int  # the epoch being trained (on_epoch_end: the one that just ended)
    loss: float | torch.Tensor  # the last step's mean loss (a device tensor)
    metrics: dict[str, float]  # the last evaluation's
    optimizer: str | None  # on_before_optimizer_step: the optimizer about to step
    # on_step_end only: the step's micro-batches, the model's outputs and the step's losses.
    batch: list[Any] | None
    outputs: list[Any] | None
    losses: dict[str, torch.Tensor] | None

    def log(self, values: Mapping[str, Any]) -> None: ...


class StepHelpers(Protocol):
    """What a `Step` is given as `tools` (hydra_ddp.step.StepTools is the loop's)."""

    def backward(
        self, model: torch.nn.Module, micro_batches: list[Any], objective: Callable[..., Any]
    ) -> dict[str, torch.Tensor]: ...

    def step(self, optimizer: torch.optim.Optimizer) -> torch.Tensor: ...


@runtime_checkable
class DataSource(Protocol):
    """One data set with "train", "val" and "test" splits, chosen by `data._target_`.

    The constructor runs in the launching process (launch/runner.py's preflight) and again on
    every rank before the process group starts: check shapes and dtypes there (a UserError
    naming the `data.*` key), not in `load`. No method may call a collective.

    - `spec`: what a model's (or a callback's) constructor receives by name, e.g.
      `{"in_features": 64, "out_features": 10}` or `{"vocab_size": ..., "block_size": ...}`.
    - `unit` and `items_per_row`: throughput is reported as `<unit>_per_s`, counting
      `items_per_row` per row (`"samples"` and 1; `"tokens"` and the block size for text).
    - `num_rows(split)`: the rows of a split, the same on every rank.
    - `load(split, ranges)`: a dataset holding only the rows in `ranges` (half-open, in order;
      None: the whole split), on every rank, each with its own ranges (a `SamplerPolicy`'s
      parts). Indexed by an int64 index array, `ds[idx]` returns one whole batch (`Rows`,
      `TokenWindows`); a source with `per_item = True` returns a map-style dataset instead,
      batched by a DataLoader (`TorchDatasets`). What is loaded is checked (finite floats,
      labels in [0, out_features), tokens in [0, vocab_size)) before training.

    Optional: `file_rows(split)` (rows per file, for `sampler.shard_by=files`); `origin(split)`
    (the split's rows as
    ranges of the original data, recorded in checkpoints so a resume that changes the split
    says so). Base with the defaults: `hydra_ddp.data.DataSource`."""

    spec: dict[str, Any]
    unit: str
    items_per_row: int

    def num_rows(self, split: str) -> int: ...

    def load(self, split: str, ranges: Ranges | None) -> Dataset: ...


@runtime_checkable
class EpochSampler(Protocol):
    """One rank's batches of row indices (into the rows it loaded), epoch by epoch; what
    `SamplerPolicy.sampler` returns.

    - `__len__()`: batches per epoch, the *same on every rank* (DDP hangs otherwise).
    - `__iter__()`: int64 index arrays, one per batch, from the resume position to the epoch's
      end; then the next epoch.
    - `state_dict()` / `load_state_dict({"epoch": e, "start_batch": b})`: the position; the
      loop sets it at each epoch start and on resume (it owns the count, not the sampler).

    Deterministic from (seed, epoch, rank): no collective, no shared RNG. Base with
    batching, drop_last and resume done: `hydra_ddp.data.sampling.EpochSampler`."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[np.ndarray]: ...

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class SamplerPolicy(Protocol):
    """Which rows each rank loads and in which order, chosen by `sampler._target_`.

    Every method is called on every rank with the same arguments and must return the same
    answer there (it decides for all ranks at once: a pure function, no collective).

    - `seed`: None becomes `trainer.seed` before first use.
    - `check(num_rows, file_rows, world, batch_size)`: raise a one-line UserError for a split
      it cannot serve; runs in the launching process before any data is loaded.
    - `rank_ranges(num_rows, file_rows, world, epoch)`: each rank's global row ranges to load
      (a list of `world` Ranges), or None (every rank loads the whole split). With
      `reloads_each_epoch = True` they are asked again at each epoch start.
    - `sampler(rows_held, rank_ranges, rank, world, batch_size)`: this rank's `EpochSampler`.
    - `eval_rank_ranges(num_rows, world)`: the rows each rank evaluates, every row once over the
      ranks (None: every rank loads the split and takes rank, rank + world, ...).
    - `rows_per_rank(rows_held, world)`: about how many rows a rank trains on (the plan).
    - `settings()`: what decides an epoch's order, recorded in checkpoints; None, or
      `{"_target_": <class>, **arguments}` so a resume that changes the policy counts the rows
      read twice or skipped.
    - `name`: what summary.json's `sampler` says.

    Base with the defaults (override `sampler`, and `rank_ranges` if ranks load only some rows):
    `hydra_ddp.data.policies.SamplerPolicy`."""

    name: str
    seed: int | None
    reloads_each_epoch: bool

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

    def eval_rank_ranges(self, num_rows: int, world: int) -> list[Ranges] | None: ...

    def rows_per_rank(self, rows_held: int, world: int) -> int: ...

    def settings(self) -> dict[str, Any] | None: ...


@runtime_checkable
class CommHook(Protocol):
    """How DDP communicates gradients, chosen by `ddp.comm_hook` (a `_target_`, or a built-in's
    name: fp16_compress, bf16_compress, powersgd). Built once in the launching process (a bad
    argument fails there) and once per rank, offered `device` by name.

    - `hook(state, bucket) -> Future[Tensor]`: what `DistributedDataParallel.register_comm_hook`
      calls for each gradient bucket, on every rank, inside the backward of the last
      micro-batch; it is *collective* (it must reduce the bucket over the ranks) and its
      future's tensor is the bucket's averaged gradient.
    - `state`: passed as `hook`'s first argument (None for a stateless hook).

    Optional: `register(ddp)` (e.g. refuse a backend in one line, then register); `name` (the
    DDP log line); `state_dict()` / `load_state_dict(state)`: checkpointed per rank (member
    `comm_hook`) and restored on resume. A plain function `(state, bucket) -> Future` as the
    `_target_` is a stateless hook. Base: `hydra_ddp.distributed.comm_hooks.CommHook`."""

    state: Any

    def hook(self, state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]: ...


@runtime_checkable
class Sink(Protocol):
    """Where a job's records go besides the per-rank JSON-lines files (which are a sink too),
    chosen by `logger.sink._target_` in conf/logger/<name>.yaml; the rest of `logger.sink.*`
    are its constructor's arguments. Built on *every* rank (by the tracker, after the resume),
    offered by name: `logger_cfg` (the typed logger group), `env` (the rank's DistEnv), `run`
    (RunInfo: output dir, job name, group, resolved config), `resumed_step` (the checkpoint's
    step, None from step 0) and `stats_dir`. A constructor that starts collectives (W&B's
    layouts agree on run ids) must do so on every rank, in the same order.

    - `log(record, step)`: each `Record` of this rank (`record.kind`: `stats`, this rank's
      stats at a log interval; `interval`, every rank's stats in `record.table` and, on rank 0,
      the cross-rank `record.aggregates`; `values`, a callback's ctx.log; `eval`, rank 0's
      val/test metrics). Keep what you want, ignore the rest. Not collective: never talk to
      other ranks here.
    - `summary(values)`: the run's final numbers, rank 0 only.
    - `add_config(values)`: more of the run's config (its provenance), every rank.
    - `close(failed, preempted)`: flush and close, once, every rank; `failed` says the run
      failed, `preempted` the signal that stopped it (0: none). Must not raise over the error
      that made the job close.

    Optional: `gathers_values = True` (rank 0 also gets the other ranks' ctx.log records: only
    rank 0 writes); `run_id` (recorded in the stats files); a static
    `check_before_launch(logger_cfg)`, called once before any worker starts, for what would
    otherwise fail on every rank (W&B's login check for `logger.mode=online`). A bad
    `_target_` fails in one line when the config is typed. Base with no-op defaults:
    `hydra_ddp.tracking.Sink`."""

    def log(self, record: Record, step: int) -> None: ...

    def summary(self, values: dict[str, float]) -> None: ...

    def add_config(self, values: dict[str, Any]) -> None: ...

    def close(self, failed: bool = False, preempted: int = 0) -> None: ...


@runtime_checkable
class Metric(Protocol):
    """An evaluation number reported as val/<name> and test/<name>, chosen by
    `metrics.<name>._target_` (conf/metrics/).

    - `sums(output, target)`: a 1-D tensor of sums over one batch (e.g. [correct, count]) on
      the output's device, called on every rank for each of its evaluation batches (name the
      second parameter `batch` to get the whole batch). The loop adds them over batches and
      then over ranks (one all-reduce), so the number is exact however rows are split.
    - `compute(totals)`: the summed list of floats -> the reported number, on every rank.

    `gathers = True`: `sums` gathers every rank's rows itself
    (`hydra_ddp.distributed.gather_for_metrics`, *collective*: every rank evaluates the same
    number of batches, so the gathers pair up), returns the global batch's sums, and they are
    counted once. Base: `hydra_ddp.metrics.Metric`."""

    gathers: bool

    def sums(self, output: Any, target: torch.Tensor) -> torch.Tensor: ...

    def compute(self, totals: list[float]) -> float: ...


class Callback(Protocol):
    """Work of yours at points of the loop, chosen by `callbacks.<name>._target_` (a dict of
    components, empty by default); its constructor may ask for `data` (the source) by name.
    Define *any subset* of the hooks (at least one): the loop calls only those a callback
    has, in config order, on *every* rank, each with a `HookContext` (step, epoch, rank,
    world_size, the unwrapped model, output_dir, last loss and metrics). A collective inside
    one must run on every rank; check `ctx.rank` for rank-0-only work. `ctx.log({...})` puts
    values into this rank's stats and sinks at the current step. A hook that raises stops the
    run with one line naming the callback.

    Optional `state_dict()` / `load_state_dict(state)`: saved in every checkpoint, each rank
    its own, and restored on resume. Optional `checkpoint_members()`: a list of `Member`s
    (objects of yours every checkpoint holds too), asked once when the job is built; a callback
    with only that method is valid. There is no base class: `hydra_ddp.callbacks` lists the
    hooks in `HOOKS`."""

    def on_train_start(self, ctx: HookContext) -> None:
        """After the resume, before the first step."""

    def on_before_optimizer_step(self, ctx: HookContext) -> None:
        """The step's gradients in the parameters' `.grad` (averaged over the ranks, unscaled
        under fp16), before clipping, the optimizer step and zero_grad; once per optimizer a
        step calls `tools.step` with (named in `ctx.optimizer`); `ctx.step` is the step being
        taken."""

    def on_step_end(self, ctx: HookContext) -> None:
        """After each step; `ctx.batch`, `ctx.outputs` and `ctx.losses` for this call only."""

    def on_eval_end(self, ctx: HookContext) -> None:
        """After each validation, its metrics in `ctx.metrics`."""

    def on_epoch_end(self, ctx: HookContext) -> None:
        """Once per epoch that ends (also with grad_accum > 1, limit_train_batches, and
        across a resume in the middle of one)."""

    def on_train_end(self, ctx: HookContext) -> None:
        """After the final validation and test, their metrics in `ctx.metrics`."""


@runtime_checkable
class Step(Protocol):
    """One optimizer step, chosen by `step._target_` (a function), else the model's
    `training_step` method, else `hydra_ddp.step.default_step`. Called by the loop on every
    rank, once per step:

        step(tools, model, micro_batches, objective, optimizers) -> {"loss": tensor, ...}

    `tools` (StepTools: `tools.backward(model, micro_batches, objective)` for forward and
    backward with `no_sync()` on all but the last micro-batch, `tools.step(optimizer)` to
    unscale, clip and step), the wrapped `model` (its forward is *collective* under DDP and
    fsdp2), the step's micro-batches on the device, the `objective` (the loss), and the
    optimizers by name (`default` with one). Returns the step's mean `loss` and any extras as
    device tensors (detached): no `.item()`, which would stall the device each step."""

    def __call__(
        self,
        tools: StepHelpers,
        model: torch.nn.Module,
        micro_batches: list[Any],
        objective: Callable[..., Any],
        optimizers: dict[str, torch.optim.Optimizer],
    ) -> dict[str, torch.Tensor]: ...


@runtime_checkable
class Stateful(Protocol):
    """What a checkpoint can hold (torch.distributed.checkpoint's Stateful): `state_dict()`
    when a checkpoint is saved, `load_state_dict(state)` on resume with what it returned.
    Tensors, numbers, strings and containers of them, so `torch.load(weights_only=True)`
    reads it back."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class Member(Protocol):
    """One entry of what a checkpoint holds (hydra_ddp.checkpoint.state): the template's
    (`state.DEFAULT_MEMBERS`) plus those each callback's `checkpoint_members()` returns, the same
    entries in the same order on every rank, declared when the job is built:

    - `name`: its key in the checkpoint.
    - `get(objects)`: the `Stateful` holding it among the job's checkpointed objects, or None
      when the job has none (neither saved nor loaded). Saving calls its `state_dict()`, resume its
      `load_state_dict(state)`, in the table's order.
    - `per_rank`: every rank saves and loads its own state (RNG, a comm hook's error
      feedback); else one global state, saved by rank 0 (fsdp2: by every rank when sharded)
      and loaded by every rank.
    - `required`: a checkpoint without it is refused; else the member starts fresh with a
      warning (a feature switched on after the checkpoint was written)."""

    @property
    def name(self) -> str: ...

    @property
    def get(self) -> Callable[[Any], Stateful | None]: ...

    @property
    def per_rank(self) -> bool: ...

    @property
    def required(self) -> bool: ...


PROTOCOLS = (
    DataSource, SamplerPolicy, EpochSampler, CommHook, Sink, Metric, Callback, HookContext, Step,
    StepHelpers, Stateful, Member,
)  # fmt: skip


def missing_members(obj: Any, protocol: type) -> list[str]:
    """The methods and attributes of `protocol` that `obj` (an instance or a class) lacks, in
    the protocol's order; Callback's hooks are each optional, so none is ever missing."""
    if protocol is Callback:
        return []
    dunders = ("__len__", "__iter__", "__call__")
    names = [n for n in vars(protocol) if not n.startswith("_") or n in dunders]
    names += list(vars(protocol).get("__annotations__", {}))
    return [n for n in dict.fromkeys(names) if not hasattr(obj, n)]
