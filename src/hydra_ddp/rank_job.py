"""What one rank's job is made of: the user's components (`build_components`, which the memory
plan and the checks before launch build alone) and the rest the rank builds before its process
group (`RankJob`, by loop/prepare.py). Below the loop, so that all of them import it downwards."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from hydra_ddp.batches import BatchLoss
from hydra_ddp.callbacks import Callbacks
from hydra_ddp.checkpoint.init_from import LoadPlan
from hydra_ddp.components import build
from hydra_ddp.config import TrainConfig
from hydra_ddp.data import DataSource, EvalData, TrainData
from hydra_ddp.distributed import DistEnv
from hydra_ddp.optim import Optimizers
from hydra_ddp.step import default_step
from hydra_ddp.tracking import RunInfo
from hydra_ddp.tracking.console import Console


@dataclass
class Components:
    """The user's components, built from their config groups before any process group."""

    model: torch.nn.Module
    loss: BatchLoss  # the loss, called as its parameters ask (hydra_ddp/batches.py)
    metrics: dict[str, Any]
    optimizers: Optimizers  # one (`default`) or several named, with their schedules
    # The function that runs one optimizer step: step.default_step, or the user's
    # step._target_ / model.training_step.
    step_fn: Callable


def build_components(cfg: TrainConfig, source: DataSource, device: torch.device,
                     total_steps: int, total_epochs: int | None = None) -> Components:  # fmt: skip
    """Model, loss, metrics, optimizers and schedules, and the step, each from its config.
    `total_epochs`: what an epoch-stepped schedule (scheduler.interval=epoch) runs for."""
    if cfg.ddp.meta_init:  # ddp.meta_init: shapes only; fsdp.wrap allocates each rank's shards
        with torch.device("meta"):
            model = build(cfg.model, "model", **source.spec)
    else:
        model = build(cfg.model, "model", **source.spec).to(device)
    if cfg.step is not None:
        step_fn = build(cfg.step, "step", _as_function=True)
    else:
        step_fn = getattr(model, "training_step", None) or default_step
    return Components(
        model=model,
        loss=BatchLoss(build(cfg.loss, "loss", _as_function=True)),
        metrics={name: build(m, f"metrics.{name}") for name, m in cfg.metrics.items()},
        optimizers=Optimizers.build(
            cfg.optim, cfg.scheduler, model, total_steps, total_epochs, ["loss", *cfg.metrics]
        ),
        step_fn=step_fn,
    )


@dataclass(kw_only=True)
class RankJob:
    """Everything one rank needs, built before the process group starts."""

    cfg: TrainConfig
    env: DistEnv
    run: RunInfo
    console: Console
    components: Components
    train_data: TrainData
    evals: dict[str, EvalData]
    micro_batches_per_epoch: int  # per rank
    total_steps: int  # optimizer steps
    total_epochs: int  # what an epoch-stepped schedule runs for
    total_micro: int | None  # micro-batches of trainer.epochs (None: trainer.max_steps)
    callbacks: Callbacks
    resume_from: Path | None
    # ddp=fsdp2: trainer.init_from's planned tensors, loaded into the shards after the wrap.
    init_sharded: LoadPlan | None = None
