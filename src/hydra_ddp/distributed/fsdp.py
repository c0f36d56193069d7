"""ddp=fsdp2: the model sharded with `torch.distributed.fsdp.fully_shard` (FSDP2).

Each rank keeps its shard (about 1/N) of every parameter, gradient and optimizer state, as
DTensors; a unit (ddp.shard_units, or the model's `fsdp_units`; the root takes the rest) is
gathered whole only for its forward and backward. `wrap` replaces the module's parameters, so
the optimizers are built after it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from typing import Any, Iterable

import torch

from hydra_ddp.config import DDPConfig, DType
from hydra_ddp.distributed import DistEnv
from hydra_ddp.errors import UserError

log = logging.getLogger(__name__)

_DTYPES = {DType.fp32: torch.float32, DType.bf16: torch.bfloat16, DType.fp16: torch.float16}


def find_units(model: torch.nn.Module, cfg: DDPConfig) -> list[tuple[str, torch.nn.Module]]:
    """The modules that become units of their own, innermost first (fully_shard is applied
    bottom-up): each entry a module class name or an fnmatch pattern of module names; one that
    matches nothing is refused, naming the classes and top-level modules there are."""
    wanted = cfg.shard_units
    if wanted is None:
        wanted = list(getattr(model, "fsdp_units", None) or [])
    named = [(name, module) for name, module in model.named_modules() if name]
    units: dict[str, torch.nn.Module] = {}
    for want in wanted:
        hit = [
            (n, m)
            for n, m in named
            if type(m).__name__ == want or fnmatch.fnmatchcase(n, str(want))
        ]
        if not hit:
            classes = sorted({type(m).__name__ for _, m in named})
            tops = [n for n, _ in named if "." not in n]
            raise UserError(
                f"ddp.shard_units: {want!r} matches no module of {type(model).__name__}: give "
                f"a module class ({', '.join(classes[:12])}) or a name pattern (top-level "
                f"modules: {', '.join(tops[:12])}; e.g. '{tops[0] if tops else 'blocks'}.*')"
            )
        units.update(hit)
    return sorted(units.items(), key=lambda item: -item[0].count("."))


def wrap(
    model: torch.nn.Module,
    env: DistEnv,
    cfg: DDPConfig,
    also: Iterable[torch.nn.Module] = (),
    compile_units: bool = False,
    autocast: bool = False,
) -> torch.nn.Module:
    """Shard `model` (and each of `also`, e.g. the EMA copy, the same way) over all ranks, in
    place; return it. `autocast`: the job's forwards run under autocast (trainer.precision
    bf16/fp16). Without a process group (one plain process) nothing is sharded."""
    units = find_units(model, cfg)
    if compile_units:
        # Per unit, before sharding: each unit's graph then ends at its all-gather and
        # reduce-scatter, which FSDP2 issues from hooks outside the compiled code.
        for _, unit in units:
            unit.compile()
    if not env.distributed:
        log.info("ddp=fsdp2 in one process without a process group: nothing to shard")
        return _materialise(model, env, also) if cfg.meta_init else model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(env.device.type, (env.world_size,))
    policy = MixedPrecisionPolicy(
        param_dtype=None if cfg.param_dtype == DType.fp32 else _DTYPES[cfg.param_dtype],
        reduce_dtype=_DTYPES[cfg.reduce_dtype],
    )
    options: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": cfg.reshard_after_forward,
        "mp_policy": policy,
    }
    # Under autocast the units need not cast their inputs (autocast casts each op's), and
    # FSDP2's cast walks every unit's arguments in Python each forward (docs/fsdp2.md).
    # Without autocast a unit of 16-bit parameters fed fp32 activations would fail.
    unit_policy = dataclasses.replace(policy, cast_forward_inputs=not autocast)
    if cfg.cpu_offload:
        # On CPU the copies are no-ops, but CI runs the path a GPU job takes.
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=env.device.type == "cuda")
    for module in (model, *also):
        mine = dict(module.named_modules())
        for name, _ in units:
            fully_shard(mine[name], **{**options, "mp_policy": unit_policy})
        # The root: everything no unit holds (embeddings, final norm, head). Its parameters
        # stay gathered after the forward: the backward starts with them.
        fully_shard(module, **{**options, "reshard_after_forward": False})
    if cfg.meta_init:
        _materialise(model, env, also)
    log.info(
        "FSDP2: %d unit(s) + root over %d rank(s) (%s), reshard_after_forward=%s "
        "param_dtype=%s reduce_dtype=%s cpu_offload=%s units_cast_inputs=%s",
        len(units),
        env.world_size,
        ", ".join(sorted({type(u).__name__ for _, u in units})) or "root only",
        cfg.reshard_after_forward,
        cfg.param_dtype.value,
        cfg.reduce_dtype.value,
        cfg.cpu_offload,
        unit_policy.cast_forward_inputs,
    )
    return model


def _materialise(
    model: torch.nn.Module, env: DistEnv, also: Iterable[torch.nn.Module]
) -> torch.nn.Module:
    """ddp.meta_init: allocate this rank's shards of a model built on the meta device and
    initialise them with the model's own code: its `init_weights()`, else every module's
    `reset_parameters()`. Buffers are allocated uninitialised: a model with buffers sets them
    in its `init_weights()`."""
    # DTensor's random ops draw each shard's part of one global stream only on accelerators; on
    # CPU every rank would draw the same values into its shard (shards equal to each other), so
    # there each rank draws from a seed of its own.
    per_rank = env.device.type == "cpu" and env.distributed
    for module in (model, *also):
        module.to_empty(device=env.device)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            if per_rank:
                torch.manual_seed(torch.initial_seed() + 7919 * env.rank)
            if callable(getattr(module, "init_weights", None)):
                module.init_weights()
            else:
                for sub in module.modules():
                    if callable(getattr(sub, "reset_parameters", None)):
                        sub.reset_parameters()
    log.info("ddp.meta_init: %s allocated as shards and initialised on each rank",
             type(model).__name__)  # fmt: skip
    return model


def reshard(model: torch.nn.Module) -> torch.nn.Module:
    """Put every unit of `model` back to its shards. The root keeps its gathered parameters
    after a forward (reshard_after_forward=False), and while it does `parameters()` returns
    those whole tensors, not the shards the optimizer and the EMA work on."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return model


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard, or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value (collective for a DTensor): a gradient norm the same on every rank."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def state_bytes(model: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """This rank's bytes of parameters + gradients + optimizer state (local shards only).
    Gradients are counted at the size they take during a step (one per trainable parameter,
    sharded like it): between steps they are freed."""
    params = list(reshard(model).parameters())
    tensors = params + [p for p in params if p.requires_grad]  # again: its gradient
    tensors += [v for o in optimizers for state in o.state.values() for v in state.values()]
    return sum(local(t).nbytes for t in tensors if torch.is_tensor(t))
