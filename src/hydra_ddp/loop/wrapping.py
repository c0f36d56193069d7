"""The model as the loop runs it: wrapped in DDP or FSDP2 once the process group is up, with
what the wrap changes around it: the EMA built before it, trainer.init_from loaded into the
shards after it, the optimizers rebuilt on FSDP2's new parameters, and torch.compile."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.swa_utils import get_ema_multi_avg_fn

from hydra_ddp.checkpoint.init_from import apply
from hydra_ddp.config import Precision, Wrapper
from hydra_ddp.distributed.ddp import wrap_model
from hydra_ddp.distributed.fsdp import local, reshard
from hydra_ddp.optim import Optimizers
from hydra_ddp.rank_job import RankJob


class EMA:
    """`trainer.ema_decay`: a moving average of the weights (buffers too, as
    `AveragedModel(use_buffers=True)`), evaluated and checkpointed while the raw weights train.

    Not torch's `AveragedModel`: it keeps its update count in a tensor and compares it on every
    update, a host-device sync per step on a GPU; here the count is an int and an update only
    queues kernels. The checkpoint keeps `AveragedModel`'s layout (`module.<name>`,
    `n_averaged`)."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        self.module = copy.deepcopy(model)
        self.module.requires_grad_(False)
        self.decay = decay
        self.n_averaged = 0
        self._average = get_ema_multi_avg_fn(decay)

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """After each optimizer step; the first copies the weights (as AveragedModel does)."""
        mine = [*reshard(self.module).parameters(), *self.module.buffers()]
        theirs = [*reshard(model).parameters(), *model.buffers()]
        # ddp=fsdp2: both are sharded alike, so each rank averages its own shards.
        pairs = [(local(a).detach(), local(b).detach()) for a, b in zip(mine, theirs)]
        floats = [(a, b) for a, b in pairs if a.is_floating_point()]
        if self.n_averaged and floats:
            self._average([a for a, _ in floats], [b for _, b in floats], None)
        for a, b in pairs:  # the first update, and integer buffers (batch counts): the latest
            if not self.n_averaged or not a.is_floating_point():
                a.copy_(b)
        self.n_averaged += 1

    def state_dict(self) -> dict[str, Any]:
        state = {f"module.{k}": v for k, v in self.module.state_dict().items()}
        state["n_averaged"] = torch.tensor(self.n_averaged, dtype=torch.long)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        weights = {k[len("module.") :]: v for k, v in state.items() if k.startswith("module.")}
        self.module.load_state_dict(weights)
        self.n_averaged = int(state["n_averaged"])


@dataclass
class Wrapped:
    """What `wrap_job` gives the loop; the raw model stays `job.components.model` (checkpoints
    use it, so their keys carry no wrapper's or `_orig_mod.` prefix)."""

    step_model: torch.nn.Module  # the DDP/FSDP2 wrapper, compiled with trainer.compile
    ema: EMA | None  # trainer.ema_decay's average
    hook_state: Any  # a DDP comm hook's per-rank state (PowerSGD's error feedback), or None
    sharded: bool  # ddp=fsdp2: model, optimizer and EMA are DTensor shards


def wrap_job(job: RankJob) -> Wrapped:
    """Collective: wrap `job.components.model` for the job's ddp.wrapper (every rank at once)."""
    cfg, env, components = job.cfg, job.env, job.components
    tcfg = cfg.trainer
    sharded = cfg.ddp.wrapper == Wrapper.fsdp2
    # Before the wrap: ddp=fsdp2 shards the average like the model (its first update copies
    # the weights, so what it starts from does not matter).
    ema = EMA(components.model, tcfg.ema_decay) if tcfg.ema_decay else None
    model, hook_state = wrap_model(
        components.model, env, cfg.ddp, also=[ema.module] if ema and sharded else (),
        compile_units=tcfg.compile and sharded, autocast=tcfg.precision != Precision.fp32,
    )  # fmt: skip
    if job.init_sharded is not None:
        apply(components.model, job.init_sharded, env.distributed)  # collective
    if sharded:  # fully_shard replaced the parameters: the optimizers must hold the new ones
        components.optimizers = Optimizers.build(
            cfg.optim, cfg.scheduler, model, job.total_steps, job.total_epochs,
            ["loss", *cfg.metrics],
        )  # fmt: skip
    # Compiled after the DDP wrap, as torch's DDP docs recommend: dynamo's DDPOptimizer then
    # splits the graph at DDP's bucket boundaries, so each bucket's all-reduce still starts
    # while the backward of the earlier layers runs (fsdp2 compiled each unit before sharding).
    step_model = torch.compile(model) if tcfg.compile and not sharded else model
    return Wrapped(step_model=step_model, ema=ema, hook_state=hook_state, sharded=sharded)
