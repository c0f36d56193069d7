"""The memory plan: what one rank holds while training, counted before the job runs, and the
measured peak it is checked against at the end of every run (summary.json).

A rank's bytes, as DeepSpeed's `estimate_zero2/zero3_model_states_mem_needs` counts them, plus
what those leave out (activations, DDP's buckets):

    params       parameters and buffers (ddp=fsdp2: this rank's shards)
    grads        one gradient per trainable parameter (fsdp2: sharded)
    optimizer    the optimizer's state after a step (fsdp2: sharded)
    buckets      DDP's gradient buckets (a copy of the gradients unless
                 ddp.gradient_as_bucket_view), with a process group only
    gathered     fsdp2: the unit-sized buffers FSDP2 holds at once in the backward (see
                 `gathered_bytes`): the root gathered whole and its unsharded gradients, and of
                 the largest other unit up to four copies (its gathered parameters, its
                 unsharded gradients, the next unit's all-gather buffer, the previous unit's
                 reduce-scatter input), in ddp.param_dtype
    activations  what the forward saves for the backward, at trainer.batch_size
    hook_state   ddp=powersgd: PowerSGD's error feedback and low-rank factors (`powersgd_bytes`)
    workspaces   CUDA: the cuBLAS workspaces torch keeps once a step has run (`workspace_bytes`)

Measured, not assumed: the model and its optimizers are built on the meta device (no memory,
any size) from the job's own config, one training step runs there through the job's step
function, and the optimizer state it creates and the tensors autograd saves are counted. The
activations are counted at two small batch sizes and extrapolated (they grow linearly with the
batch). A model whose forward cannot run on the meta device (it reads a tensor's value) is run
on the CPU with a small batch instead.

The peak a step reaches is `params + optimizer + buckets + gathered + hook_state + workspaces +
max(activations, grads)`: the gradients are made during the backward as the activations are
freed, and freed after the optimizer step (zero_grad(set_to_none=True)).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.fsdp import FSDPModule

from hydra_ddp.batches import to_device
from hydra_ddp.components import build
from hydra_ddp.config import DType, Precision, TrainConfig, Wrapper
from hydra_ddp.data import DataSource, TrainData
from hydra_ddp.distributed import DistEnv, all_gather_floats
from hydra_ddp.distributed.fsdp import find_units, local
from hydra_ddp.memory_rules import gathered_bytes, powersgd_bytes, workspace_bytes
from hydra_ddp.rank_job import build_components
from hydra_ddp.step import StepTools
from hydra_ddp.tracking.peak import PeakMeter

log = logging.getLogger(__name__)

# The two batch sizes the activations are counted at; the plan extrapolates from them.
_PROBE_ROWS = (2, 4)
_HALF = {DType.bf16, DType.fp16}
# Models up to this size are counted on the CPU, for real (it is faster than the meta device,
# whose operators run in Python); bigger ones on the meta device.
_CPU_LIMIT = 256 * 2**20


@dataclass
class MemoryPlan:
    """One rank's planned bytes (see the module docstring); `activations` at `batch_size`."""

    wrapper: str
    world_size: int
    batch_size: int
    params: int
    grads: int
    optimizer: int
    buckets: int
    gathered: int
    activations: int
    activations_per_row: float
    where: str  # where the step ran to count them: meta or cpu
    hook_state: int = 0
    workspaces: int = 0

    @property
    def peak(self) -> int:
        fixed = self.params + self.optimizer + self.buckets + self.gathered
        return fixed + self.hook_state + self.workspaces + max(self.activations, self.grads)

    def at(self, batch_size: int) -> MemoryPlan:
        """The same plan at another trainer.batch_size."""
        fixed = self.activations - self.activations_per_row * self.batch_size
        acts = int(max(fixed + self.activations_per_row * batch_size, 0))
        return dataclasses.replace(self, batch_size=batch_size, activations=acts)

    def largest_batch(self, device_bytes: int) -> int:
        """The largest trainer.batch_size whose peak fits `device_bytes` (0: none does)."""
        if self.at(1).peak > device_bytes:
            return 0
        if self.activations_per_row <= 0:
            return sys.maxsize
        lo, hi = 1, 2
        while self.at(hi).peak <= device_bytes:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.at(mid).peak <= device_bytes else (lo, mid)
        return lo

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "peak": self.peak}


@dataclass
class Counted:
    """What one step on the meta device (or the CPU) counted, for the whole model (no
    sharding): the pieces `plan_memory` divides and combines."""

    params: int
    values: int  # parameters, counted
    trainable: int
    optimizer: int
    root_unit: int  # parameters no fsdp2 unit holds
    units: list[int]  # each fsdp2 unit's own parameters (the root's left out)
    activations: dict[int, int]  # probe batch size -> saved bytes
    where: str
    hook_state: int = 0  # ddp=powersgd's state (powersgd_bytes)


def count(cfg: TrainConfig, source: DataSource) -> Counted:
    """Build the job's model and optimizers, run a step at each probe batch size and count: on
    the CPU for a model of up to `_CPU_LIMIT` bytes (fast), else on the meta device (no memory,
    any size), and on the CPU too when the model cannot run on the meta device."""
    with torch.device("meta"):
        size = sum(_nbytes(p) for p in build(cfg.model, "model", **source.spec).parameters())
    if size <= _CPU_LIMIT:
        return _count(cfg, source, torch.device("cpu"))
    try:
        return _count(cfg, source, torch.device("meta"))
    except (NotImplementedError, RuntimeError):
        # A forward that reads a value (`.item()`, a data-dependent shape): run it for real.
        return _count(cfg, source, torch.device("cpu"))


def plan_memory(counted: Counted, cfg: TrainConfig, world_size: int, wrapper: Wrapper,
         distributed: bool | None = None, device: str = "cpu") -> MemoryPlan:  # fmt: skip
    """One rank's plan under `wrapper` on `world_size` ranks, at trainer.batch_size, on
    `device` (cpu or cuda); `distributed`: with a process group (default: more than one rank),
    so wrapped."""
    wrapped = world_size > 1 if distributed is None else distributed
    (b1, a1), (b2, a2) = sorted(counted.activations.items())
    per_row = (a2 - a1) / (b2 - b1)
    half = cfg.trainer.precision in (Precision.bf16, Precision.fp16)
    sharded = wrapper == Wrapper.fsdp2 and wrapped
    if wrapper == Wrapper.fsdp2:
        half = half or cfg.ddp.param_dtype in _HALF
    scale = 0.5 if half else 1.0  # 16-bit autocast: the saved floats take half the bytes
    shard = world_size if sharded else 1
    gathered = gathered_bytes(counted.root_unit, counted.units, cfg) if sharded else 0
    buckets = 0
    ddp = wrapper == Wrapper.ddp and wrapped and cfg.ddp.enabled
    if ddp:
        buckets = 0 if cfg.ddp.gradient_as_bucket_view else counted.trainable
    return MemoryPlan(
        wrapper=wrapper.value,
        world_size=world_size,
        batch_size=b1,
        params=-(-counted.params // shard),
        grads=-(-counted.trainable // shard),
        optimizer=-(-counted.optimizer // shard),
        buckets=buckets,
        gathered=gathered,
        activations=int(a1 * scale),
        activations_per_row=per_row * scale,
        where=counted.where,
        hook_state=counted.hook_state if ddp else 0,
        workspaces=workspace_bytes(cfg, device, ddp),
    ).at(cfg.trainer.batch_size)


def _count(cfg: TrainConfig, source: DataSource, device: torch.device) -> Counted:
    probe = dataclasses.replace(cfg, optim=_unfused(cfg.optim)) if device.type == "meta" else cfg
    acts: dict[int, int] = {}
    meta = torch.device("meta") if device.type == "meta" else contextlib.nullcontext()
    with torch.random.fork_rng(devices=[]), meta:  # the job's random streams stay as they were
        components = build_components(probe, source, device, total_steps=1)
        model, optimizers = components.model, components.optimizers.optimizers
        tools = StepTools(
            torch.amp.GradScaler("cpu", enabled=False),
            contextlib.nullcontext(),
            cfg.trainer.grad_clip,
            skip_non_finite=False,  # reading the norm is impossible on the meta device
            raw_model=model,
            optimizers=optimizers,
        )
        own = {id(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())}
        model.train()
        for rows in _PROBE_ROWS:
            batch = to_device(_first_batch(cfg, source, rows), device)
            saved: dict[int, int] = {}

            def pack(t: torch.Tensor, saved: dict = saved) -> torch.Tensor:
                storage = t.untyped_storage()
                if id(storage) not in own:
                    saved[id(storage)] = storage.nbytes()
                return t

            with saved_tensors_hooks(pack, lambda t: t):
                components.step_fn(tools, model, [batch], components.loss, optimizers)
            acts[rows] = sum(saved.values())
    tensors = [*model.parameters(), *model.buffers()]
    units = find_units(model, cfg.ddp)
    unit_bytes = [_own_bytes(unit, units) for _, unit in units]
    return Counted(
        params=sum(_nbytes(t) for t in tensors),
        values=sum(p.numel() for p in model.parameters()),
        trainable=sum(_nbytes(p) for p in model.parameters() if p.requires_grad),
        optimizer=sum(_state_bytes(o) for o in optimizers.values()),
        root_unit=sum(_nbytes(p) for p in model.parameters()) - sum(unit_bytes),
        units=unit_bytes,
        activations=acts,
        where=device.type,
        hook_state=powersgd_bytes([*model.parameters()], cfg),
    )


def _first_batch(cfg: TrainConfig, source: DataSource, rows: int) -> Any:
    data = TrainData(source, cfg.sampler, DistEnv(), rows, cfg.sampler_seed, 0)
    return next(iter(data.epoch(0)))


def _unfused(optim: Any) -> Any:
    """The optimizer config with `fused` off (no fused kernel runs on the meta device; the state
    it keeps is the same)."""
    if not isinstance(optim, dict):
        return optim
    return {
        k: (False if k == "fused" else _unfused(v) if isinstance(v, dict) else v)
        for k, v in optim.items()
    }


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _own_bytes(unit: torch.nn.Module, units: list[tuple[str, torch.nn.Module]]) -> int:
    """A unit's parameters that no unit inside it holds."""
    inner = {id(p) for _, u in units if u is not unit for p in u.parameters()}
    return sum(_nbytes(p) for p in unit.parameters() if id(p) not in inner)


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        _nbytes(local(v))
        for s in optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )


def of_this_run(
    cfg: TrainConfig, env: DistEnv, model: torch.nn.Module, optimizers: Any, meter: PeakMeter
) -> MemoryPlan | None:
    """The plan's sum for this run, from what it holds (this rank's shards, its optimizer
    state) and what its own step saved for the backward (`meter.saving`), with no step or
    data read of its own: a user's model and data see nothing more than training did."""
    if meter.activations is None:
        return None
    params = [*model.parameters()]
    trainable = sum(_local_bytes(p) for p in params if p.requires_grad)
    sharded = cfg.ddp.wrapper == Wrapper.fsdp2 and env.distributed
    gathered = 0
    if sharded:  # the units as fully_shard made them (their classes renamed FSDP<name>)
        units = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule) and n]
        unit_bytes = [_own_bytes(unit, units) for _, unit in units]
        root = sum(_nbytes(p) for p in params) - sum(unit_bytes)
        gathered = gathered_bytes(root, unit_bytes, cfg)
    ddp = cfg.ddp.wrapper == Wrapper.ddp and env.distributed and cfg.ddp.enabled
    return MemoryPlan(
        wrapper=cfg.ddp.wrapper.value,
        world_size=env.world_size,
        batch_size=cfg.trainer.batch_size,
        params=sum(_local_bytes(t) for t in (*params, *model.buffers())),
        grads=trainable,
        optimizer=sum(_state_bytes(o) for o in optimizers),
        buckets=trainable if ddp and not cfg.ddp.gradient_as_bucket_view else 0,
        gathered=gathered,
        activations=meter.activations,
        activations_per_row=meter.activations / max(meter.rows, 1),
        where="run",
        hook_state=powersgd_bytes(params, cfg) if ddp else 0,
        workspaces=workspace_bytes(cfg, env.device.type, ddp),
    )


def of_this_run_or_none(*args: Any) -> MemoryPlan | None:
    """`of_this_run`, or None with a warning: the run's results matter more than its plan."""
    try:
        return of_this_run(*args)
    except Exception as e:
        log.warning("no memory plan in summary.json: %s: %s", type(e).__name__, e)
        return None


def memory_summary(plan_of_run: MemoryPlan | None, env: DistEnv, meter: PeakMeter) -> dict:
    """Collective: summary.json's memory entries: this run's plan (`of_this_run`), every rank's
    measured peak (tracking/peak.py), and the largest over the plan."""
    peaks = [int(p[0]) for p in all_gather_floats([meter.peak() or -1], env)]
    out: dict[str, Any] = {
        "memory_plan": plan_of_run.as_dict() if plan_of_run else None,
        "memory_peak_per_rank": [p if p >= 0 else None for p in peaks],
        "memory_peak_measure": meter.method,
    }
    if plan_of_run and min(peaks) >= 0:
        out["memory_peak_over_plan"] = max(peaks) / plan_of_run.peak
    return out


def _local_bytes(t: torch.Tensor) -> int:
    return _nbytes(local(t))
