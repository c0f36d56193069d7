"""The memory plan: what one rank holds while training, counted before the job runs
(`python -m hydra_ddp.plan`), and the measured peak every run checks it against (summary.json).

Its rows are DeepSpeed's model-state estimate (parameters, gradients, optimizer state) plus what
that leaves out: DDP's buckets, FSDP2's gathered units, activations, PowerSGD's state and the
cuBLAS workspaces of a CUDA job. What each row counts, what is measured (one step of the job's
own model, optimizers and step function at two small batch sizes) and what is estimated, and
how well the plan holds: docs/memory_plan.md. The gradients are made as the activations are
freed and freed after the step, so the peak is everything else plus the larger of the two.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from hydra_ddp.batches import to_device
from hydra_ddp.components import build
from hydra_ddp.config import COMM_HOOKS, DType, TrainConfig, Wrapper
from hydra_ddp.data import DataSource, TrainData
from hydra_ddp.distributed import DistEnv, all_gather_floats
from hydra_ddp.distributed.fsdp import find_units, local
from hydra_ddp.rank_job import build_components
from hydra_ddp.step import StepTools
from hydra_ddp.tracking.peak import PeakMeter, saved_bytes

log = logging.getLogger(__name__)

# The two batch sizes the activations are counted at; the plan extrapolates from them.
_PROBE_ROWS = (2, 4)
_HALF = {DType.bf16, DType.fp16}
# Models up to this size are counted on the CPU, for real (it is faster than the meta device,
# whose operators run in Python); bigger ones on the meta device.
_CPU_LIMIT = 256 * 2**20
# torch's pool of CUDA streams a future's callbacks run on: 32 per device and priority, handed
# out in turn (c10/cuda/CUDAStream.h).
_POOL_STREAMS = 32


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
    where: str  # where the step ran to count them: meta, cpu, or this run's own step
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


@dataclass
class Counted:
    """What one step counted, for the whole model (no sharding)."""

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
    the CPU for a model of up to `_CPU_LIMIT` bytes, else on the meta device, and on the CPU
    after all when the model cannot run on the meta device."""
    with torch.device("meta"):
        size = sum(p.nbytes for p in build(cfg.model, "model", **source.spec).parameters())
    if size <= _CPU_LIMIT:
        return _count(cfg, source, torch.device("cpu"))
    try:
        return _count(cfg, source, torch.device("meta"))
    except (NotImplementedError, RuntimeError):
        # A forward that reads a value (`.item()`, a data-dependent shape): run it for real.
        return _count(cfg, source, torch.device("cpu"))


def plan_memory(
    counted: Counted, cfg: TrainConfig, world_size: int, wrapper: Wrapper, device: str = "cpu"
) -> MemoryPlan:
    """One rank's plan under `wrapper` on `world_size` ranks (wrapped when more than one), at
    trainer.batch_size, on `device` (cpu or cuda)."""
    (b1, a1), (b2, a2) = sorted(counted.activations.items())
    half = cfg.trainer.precision in _HALF or (
        wrapper == Wrapper.fsdp2 and cfg.ddp.param_dtype in _HALF
    )
    scale = 0.5 if half else 1.0  # 16-bit autocast: the saved floats take half the bytes
    wrapped = world_size > 1
    shard = world_size if wrapper == Wrapper.fsdp2 and wrapped else 1
    return _plan(
        counted, cfg, world_size, wrapper, device, wrapped, shard, b1, int(a1 * scale),
        (a2 - a1) / (b2 - b1) * scale,
    ).at(cfg.trainer.batch_size)  # fmt: skip


def _plan(counted: Counted, cfg: TrainConfig, world_size: int, wrapper: Wrapper, device: str,
          wrapped: bool, shard: int, batch_size: int, activations: int,
          per_row: float) -> MemoryPlan:  # fmt: skip
    """The plan from `counted`'s bytes, the model states split in `shard`s; `wrapped`: in a
    process group (DDP's buckets, fsdp2's gathered units, a comm hook's state)."""
    ddp = wrapper == Wrapper.ddp and wrapped and cfg.ddp.enabled
    return MemoryPlan(
        wrapper=wrapper.value,
        world_size=world_size,
        batch_size=batch_size,
        params=-(-counted.params // shard),
        grads=-(-counted.trainable // shard),
        optimizer=-(-counted.optimizer // shard),
        buckets=counted.trainable if ddp and not cfg.ddp.gradient_as_bucket_view else 0,
        gathered=(
            gathered_bytes(counted.root_unit, counted.units, cfg)
            if wrapper == Wrapper.fsdp2 and wrapped
            else 0
        ),
        activations=activations,
        activations_per_row=per_row,
        where=counted.where,
        hook_state=counted.hook_state if ddp else 0,
        workspaces=workspaces(cfg, ddp) * cublas_workspace_size() if device == "cuda" else 0,
    )


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
            data = TrainData(source, cfg.sampler, DistEnv(), rows, cfg.sampler_seed, 0)
            batch = to_device(next(iter(data.epoch(0))), device)
            with saved_bytes(skip=lambda storage: id(storage) in own) as saved:
                components.step_fn(tools, model, [batch], components.loss, optimizers)
            acts[rows] = sum(saved.values())
    units = find_units(model, cfg.ddp)
    return _held(model, optimizers.values(), units, cfg, device.type, activations=acts)


def _unfused(optim: Any) -> Any:
    """The optimizer config with `fused` off (no fused kernel runs on the meta device; the state
    it keeps is the same)."""
    if not isinstance(optim, dict):
        return optim
    return {
        k: (False if k == "fused" else _unfused(v) if isinstance(v, dict) else v)
        for k, v in optim.items()
    }


def _held(
    model: torch.nn.Module,
    optimizers: Any,
    units: list[tuple[str, torch.nn.Module]],
    cfg: TrainConfig,
    where: str,
    activations: dict[int, int],
) -> Counted:
    """What `model` and `optimizers` hold on this rank (a DTensor's local shard), the `units`
    (fsdp2's) and the root counted whole."""
    params = [*model.parameters()]
    unit_bytes = [_own_bytes(unit, units) for _, unit in units]
    states = [v for o in optimizers for s in o.state.values() for v in s.values()]
    return Counted(
        params=sum(local(t).nbytes for t in (*params, *model.buffers())),
        values=sum(p.numel() for p in params),
        trainable=sum(local(p).nbytes for p in params if p.requires_grad),
        optimizer=sum(local(v).nbytes for v in states if torch.is_tensor(v)),
        root_unit=sum(p.nbytes for p in params) - sum(unit_bytes),
        units=unit_bytes,
        activations=activations,
        where=where,
        hook_state=powersgd_bytes(params, cfg),
    )


def _own_bytes(unit: torch.nn.Module, units: list[tuple[str, torch.nn.Module]]) -> int:
    """A unit's parameters that no unit inside it holds."""
    inner = {id(p) for _, u in units if u is not unit for p in u.parameters()}
    return sum(p.nbytes for p in unit.parameters() if id(p) not in inner)


def of_this_run(
    cfg: TrainConfig, env: DistEnv, model: torch.nn.Module, optimizers: Any, meter: PeakMeter
) -> MemoryPlan | None:
    """The plan's sum for this run, from what it holds (this rank's shards, its optimizer
    state) and what its own step saved for the backward (`meter.saving`): no step or data read
    of its own, so a user's model and data see nothing more than training did. None, with a
    warning, when it cannot be counted: the run's results matter more than its plan."""
    if meter.activations is None:
        return None
    try:
        # The units as fully_shard made them (their classes renamed FSDP<name>), if it did.
        units = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule) and n]
        held = _held(model, optimizers, units, cfg, "run", activations={})
        return _plan(
            held, cfg, env.world_size, cfg.ddp.wrapper, env.device.type, env.distributed, 1,
            cfg.trainer.batch_size, meter.activations, meter.activations / max(meter.rows, 1),
        )  # fmt: skip
    except Exception as e:
        log.warning("no memory plan in summary.json: %s: %s", type(e).__name__, e)
        return None


def memory_summary(plan_of_run: MemoryPlan | None, env: DistEnv, meter: PeakMeter) -> dict:
    """Collective: summary.json's memory entries: this run's plan (`of_this_run`), every rank's
    measured peak (tracking/peak.py), and the largest over the plan."""
    peaks = [int(p[0]) for p in all_gather_floats([meter.peak() or -1], env)]
    out: dict[str, Any] = {
        "memory_plan": {**dataclasses.asdict(plan_of_run), "peak": plan_of_run.peak}
        if plan_of_run
        else None,
        "memory_peak_per_rank": [p if p >= 0 else None for p in peaks],
        "memory_peak_measure": meter.method,
    }
    if plan_of_run and min(peaks) >= 0:
        out["memory_peak_over_plan"] = max(peaks) / plan_of_run.peak
    return out


# What torch allocates beyond the model's and the optimizer's tensors: the rules, each from the
# library's documented behaviour or its source, are laid out in docs/memory_plan.md.


def gathered_bytes(root: int, units: list[int], cfg: TrainConfig) -> int:
    """The unit-sized buffers fully_shard holds at once on a rank at the backward's peak, from
    the whole bytes of the root's own parameters and of each other unit's (torch 2.13): the
    root and its unsharded gradients, and of the largest unit up to four copies (two with one
    unit, three with two), or every unit without ddp.reshard_after_forward. In
    ddp.param_dtype (autograd makes the gradients in the gathered parameters' dtype)."""
    largest = max(units, default=0)
    if cfg.ddp.reshard_after_forward:
        held = min(len(units) + 1, 4) * largest if units else 0
    else:
        held = sum(units) + min(len(units), 2) * largest
    scale = 0.5 if cfg.ddp.param_dtype in _HALF else 1.0
    return int(scale * (2 * root + held))


def powersgd(cfg: TrainConfig) -> tuple[int, int] | None:
    """(rank, start_iter) where ddp.comm_hook is the template's PowerSGD, else None."""
    hook = cfg.ddp.comm_hook
    if isinstance(hook, str) and COMM_HOOKS.get(hook) == "PowerSGD":
        return cfg.ddp.powersgd_rank, cfg.ddp.powersgd_start_iter
    if isinstance(hook, dict) and str(hook.get("_target_", "")).endswith("comm_hooks.PowerSGD"):
        return int(hook["rank"]), int(hook["start_iter"])
    return None


def powersgd_bytes(parameters: list[torch.Tensor], cfg: TrainConfig) -> int:
    """PowerSGD's state: its error feedback (a copy of the gradients), a bucket and its new
    error while the hook runs on it, and the low-rank factors P (n x r) and Q (m x r) it keeps
    of each gradient it compresses (those where (n + m) r is under half of n m)."""
    found = powersgd(cfg)
    if found is None:
        return 0
    grads = [p for p in parameters if p.requires_grad]
    errors = sum(p.nbytes for p in grads)
    factors = 0
    for p in grads:
        n = p.shape[0] if p.dim() else 1
        m = p.numel() // max(n, 1)
        r = min(n, m, found[0])
        if 2 * (n + m) * r < n * m:
            factors += (n + m) * r * p.element_size()
    return errors + 2 * min(errors, int(cfg.ddp.bucket_cap_mb * 2**20)) + factors


def workspaces(cfg: TrainConfig, ddp: bool) -> int:
    """cuBLAS workspaces a CUDA job keeps, one per handle and stream that ran a matmul: the
    forward's and autograd's backward thread's, and PowerSGD's on each of torch's pool streams."""
    return 2 + (_POOL_STREAMS if ddp and powersgd(cfg) else 0)


def cublas_workspace_size() -> int:
    """One cuBLAS workspace on the current GPU: torch's own answer (torch >= 2.13), else
    CUBLAS_WORKSPACE_CONFIG's, else torch's default: 32 MiB on Hopper, else 8 MiB + 128 KiB."""
    query = getattr(torch.backends.cuda, "cublas_workspace_size", None)
    if query is not None:
        return int(query())
    configured = workspace_config(os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if configured is not None:
        return configured
    hopper = torch.cuda.get_device_capability() == (9, 0)
    return 32 * 2**20 if hopper else (4096 * 2 + 16 * 8) * 2**10


def workspace_config(text: str) -> int | None:
    """The bytes CUBLAS_WORKSPACE_CONFIG sets (`:4096:8`: 8 x 4096 KiB), None if it sets none."""
    pairs = re.findall(r":([0-9]+):([0-9]+)", text)
    return sum(int(size) * int(count) for size, count in pairs) * 2**10 if pairs else None


def window_steps(cfg: TrainConfig, device: torch.device) -> int:
    """The steps the measured peak covers after the first: 4 (a steady step repeats itself),
    and on CUDA with PowerSGD until its callbacks, three a step on the next pool stream in
    turn, have run on every one of them (its workspaces all made)."""
    found = powersgd(cfg) if device.type == "cuda" and cfg.ddp.wrapper == Wrapper.ddp else None
    return PeakMeter.STEPS if found is None else found[1] + _POOL_STREAMS + 1
