"""The validation metric that judges a run (`trainer.monitor`, `trainer.monitor_mode`): the
best step (its checkpoint kept as `checkpoints/best.pt`), early stopping after
`trainer.early_stop_patience` evaluations without an improvement, and a pruning sweep's stop
(pruning.py). Checkpointed, so a resumed run keeps its best score and its patience count.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from hydra_ddp.config import MonitorMode, TrainConfig, TrainerConfig
from hydra_ddp.distributed import DistEnv, all_gather_objects
from hydra_ddp.errors import UserError

log = logging.getLogger(__name__)


def monitor_key(cfg: TrainConfig) -> str:
    """The key of the validation metrics that `trainer.monitor` names (`val/acc` -> `acc`); a
    name the job does not compute fails before training, not after it."""
    available = ["loss", *cfg.metrics]
    key = cfg.trainer.monitor[len("val/") :]
    if key not in available:
        raise UserError(
            f"trainer.monitor={cfg.trainer.monitor} is not a validation metric of this job: "
            f"use one of {', '.join('val/' + name for name in available)} (the loss and the "
            "metrics config group)"
        )
    return key


class Monitor:
    def __init__(self, tcfg: TrainerConfig, metric: str) -> None:
        self.name = tcfg.monitor
        self.metric = metric  # the key in the evaluation's results: `val/acc` -> `acc`
        self.maximize = tcfg.monitor_mode == MonitorMode.max
        self.patience = tcfg.early_stop_patience
        self.best = math.nan
        self.best_step = 0
        self.bad_evals = 0  # evaluations in a row without an improvement
        self.stopped_early = False
        self.pruned = False  # stopped by a pruning sweep's pruner (pruning.py)

    def update(self, step: int, val: dict[str, float], env: DistEnv) -> bool:
        """Record an evaluation at `step`; True when it is the best so far."""
        value = val[self.metric]
        improved = math.isfinite(value) and (
            math.isnan(self.best) or (value > self.best if self.maximize else value < self.best)
        )
        # Bit-equal on every rank in practice, but a stop that one rank alone takes would hang
        # the others: rank 0 decides for all.
        improved = bool(all_gather_objects(improved, env)[0])
        if improved:
            self.best, self.best_step, self.bad_evals = value, step, 0
        else:
            self.bad_evals += 1
        return improved

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.bad_evals >= self.patience

    def stop(self, step: int) -> None:
        self.stopped_early = True
        log.info(
            "early stop at step %d: %s has not improved for %d evaluation(s) "
            "(trainer.early_stop_patience); best %.6g at step %d",
            step,
            self.name,
            self.bad_evals,
            self.best,
            self.best_step,
        )

    def prune(self, step: int, value: float) -> None:
        """A pruning sweep stops this trial at `step`: it ends as an early stop does."""
        self.stopped_early = self.pruned = True
        log.info(
            "pruned at step %d: the sweep's pruner (hydra.sweeper.pruner) stops this trial at "
            "%s %.6g; best %.6g at step %d",
            step,
            self.name,
            value,
            self.best,
            self.best_step,
        )

    def summary(self) -> dict[str, Any]:
        return {
            "monitor": self.name,
            "best": None if math.isnan(self.best) else self.best,
            "best_step": self.best_step,
            "stopped_early": self.stopped_early,
            "pruned": self.pruned,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "bad_evals": self.bad_evals}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = float(state["best"])
        self.best_step = int(state["best_step"])
        self.bad_evals = int(state["bad_evals"])
