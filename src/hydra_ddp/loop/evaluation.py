"""Validation during training (`Evaluator`), judged by the metric `trainer.monitor` names
(`Monitor`: the best step, its checkpoint kept as `checkpoints/best.pt`, early stopping after
`trainer.early_stop_patience` evaluations without an improvement, a pruning sweep's stop:
`Pruning`), and the evaluation of a saved checkpoint (`evaluate_run`, behind
`python -m hydra_ddp.eval`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from hydra_ddp import checkpoint
from hydra_ddp.checkpoint import Checkpointer
from hydra_ddp.checkpoint.state import load_model_state
from hydra_ddp.components import build
from hydra_ddp.config import MonitorMode, TrainConfig, TrainerConfig
from hydra_ddp.data import EvalData
from hydra_ddp.distributed import DistEnv, all_gather_objects, process_group, use_device
from hydra_ddp.distributed.ddp import sync_buffers
from hydra_ddp.distributed.failures import translated
from hydra_ddp.launcher_env import OPTUNA_STORAGE_ENV as STORAGE_ENV
from hydra_ddp.launcher_env import OPTUNA_STUDY_ENV as STUDY_ENV
from hydra_ddp.launcher_env import OPTUNA_TRIAL_ENV as TRIAL_ENV
from hydra_ddp.loop import PRUNED_ATTR, PRUNER_ATTR
from hydra_ddp.loop.scoring import evaluate, predict
from hydra_ddp.metrics import Metric
from hydra_ddp.optim import val_metric
from hydra_ddp.rundir import jsonfile
from hydra_ddp.step import autocast_for
from hydra_ddp.tracking import RunInfo, Tracker
from hydra_ddp.tracking.console import Console

log = logging.getLogger(__name__)


def monitor_key(cfg: TrainConfig) -> str:
    """The key of the validation metrics that `trainer.monitor` names (`val/acc` -> `acc`)."""
    return val_metric(cfg.trainer.monitor, "trainer.monitor", ["loss", *cfg.metrics])


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
        self.pruned = False  # stopped by a pruning sweep's pruner (`Pruning`)

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


class Pruning:
    """Collective: a job that is one trial of a pruning Optuna sweep (`hydra/sweeper=optuna_pruned`)
    reports the monitored metric at every evaluation and stops when the study's pruner says so;
    a no-op outside one. The sweeper names the study's storage, the study and the job's trial in
    three variables of `hydra.job.env_set`. Global rank 0 alone reports, through Optuna's
    `Trial`; the others follow its decision. A pruned job ends like an early stop and marks its
    trial with the step."""

    def __init__(self, env: DistEnv) -> None:
        self.env = env
        self.active = TRIAL_ENV in os.environ
        self.trial = _trial() if self.active and env.is_main else None

    def should_prune(self, step: int, value: float) -> bool:
        """Collective: report `value` at `step` to the trial; True on every rank when rank 0's
        pruner stops the trial there (rank 0 then marks it with the step)."""
        if not self.active:
            return False
        pruned = False
        if self.trial is not None:
            # NaN is what the pruners expect of a diverged run: they prune it.
            self.trial.report(float(value) if math.isfinite(value) else float("nan"), step)
            pruned = self.trial.should_prune()
            if pruned:
                self.trial.set_user_attr(PRUNED_ATTR, step)
        # One rank alone stopping would leave the others waiting in a collective.
        return bool(all_gather_objects(pruned, self.env)[0])


def _trial() -> Any:
    """This job's trial, with the sweep's pruner. The storage variable holds an Optuna storage
    URL, or the JSON of a storage's config (`_target_` and arguments)."""
    import optuna
    from hydra.utils import instantiate

    spec, name = os.environ[STORAGE_ENV], os.environ[STUDY_ENV]
    storage = optuna.storages.get_storage(instantiate(json.loads(spec)) if spec[0] == "{" else spec)
    study = optuna.load_study(study_name=name, storage=storage)
    study.pruner = instantiate(study.user_attrs[PRUNER_ATTR])
    ids = storage.get_study_id_from_name(name), int(os.environ[TRIAL_ENV])
    return optuna.trial.Trial(study, storage.get_trial_id_from_study_id_trial_number(*ids))


@dataclass(kw_only=True)
class Evaluator:
    env: DistEnv
    splits: dict[str, EvalData]
    model: torch.nn.Module  # the module evaluated: the raw one, or the EMA average
    loss_fn: Callable
    metrics: Mapping[str, Metric]
    autocast: contextlib.AbstractContextManager
    limit: int
    interval: int
    total_steps: int
    monitor: Monitor
    checkpointer: Checkpointer
    tracker: Tracker
    console: Console
    pruning: Pruning
    last: dict[str, float] = field(default_factory=dict, init=False)  # the newest validation's
    _improved: bool = field(default=False, init=False)  # the final validation improved the monitor

    def due(self, step: int) -> bool:
        """Every `interval` steps (0: never); the end of the run validates anyway."""
        return bool(self.interval) and step % self.interval == 0 and step < self.total_steps

    def evaluate(self, split: str) -> dict[str, float]:
        """Collective: the loss and metrics of `split`, exact over all ranks, every rank with
        rank 0's buffers (BatchNorm statistics): those the checkpoint saves."""
        sync_buffers([self.model], self.env)  # collective
        scoring = (self.loss_fn, self.metrics, self.autocast, self.limit)
        return evaluate(self.model, self.splits[split], self.env, *scoring)

    def validate(self, position: Any) -> dict[str, float]:
        """Collective: validate at `position`; keep its checkpoint as best.pt if the monitor
        improved; stop early after too many evaluations without."""
        val = self.last = self.evaluate("val")
        self.tracker.log_eval(position.step, prefixed("val", val))
        shown = " ".join(f"{k} {v:.4f}" for k, v in val.items())
        self.console.info_main("step %d | val %s", position.step, shown)
        if self.monitor.update(position.step, val, self.env):  # collective
            self.checkpointer.save(name="best.pt")  # collective
        elif self.monitor.should_stop:
            self.monitor.stop(position.step)
        # A trial of a pruning sweep: report, maybe stop here (a no-op outside one).
        value = val[self.monitor.metric]
        if self.pruning.should_prune(position.step, value):  # collective
            self.monitor.prune(position.step, value)
        return val

    def final_validation(self, position: Any) -> dict[str, float]:
        """Collective, at the end of the run: validate (unless early stopping just did) and
        tell the monitor before the last checkpoint (`finish`, after the loop's `on_eval_end`),
        so a longer run resumed from it continues with the right best score and patience."""
        self._improved = False
        if not self.monitor.stopped_early:  # else the loop evaluated this very step already
            self.last = self.evaluate("val")
            self._improved = self.monitor.update(position.step, self.last, self.env)
        return self.last

    def finish(self, position: Any) -> tuple[dict[str, float], dict[str, float]]:
        """Collective: save the last checkpoint (kept as best.pt too when the last validation
        improved), and test. Returns (val, test) metrics."""
        self.checkpointer.save()
        if self._improved:
            self.checkpointer.keep_as_best(position.step)
        test = self.evaluate("test")
        self.tracker.log_eval(
            position.step, {**prefixed("val", self.last), **prefixed("test", test)}
        )
        return self.last, test


def prefixed(split: str, metrics: dict[str, float]) -> dict[str, float]:
    return {f"{split}/{k}": v for k, v in metrics.items()}


# --------------------------------------------------------------------------------------------
# A saved checkpoint: python -m hydra_ddp.eval
# --------------------------------------------------------------------------------------------


@dataclass
class Request:
    run: Path
    ckpt: str = "last"
    split: str = "test"
    predict: bool = False
    predict_key: str | None = None  # the entry of a dict output to predict (default: all)
    predict_pad: float | None = None  # pad entries of varying shape with this (default: a list)


def evaluate_run(cfg: TrainConfig, env: DistEnv, run: RunInfo, request: Request) -> dict:
    """One rank's share: rebuild the model and the split, load the checkpoint, evaluate (and
    predict). Returns the metrics, the same on every rank."""
    use_device(env)
    path, state = checkpoint.read_picked(request.run, request.ckpt)
    source = build(cfg.data, "data")
    split = EvalData(source, request.split, cfg.sampler, env, cfg.trainer.batch_size)
    model = build(cfg.model, "model", **source.spec)
    if "ema" in state:  # the run evaluated its average: so do we
        log.info("evaluating the EMA weights of %s", path)
    load_model_state(
        model, checkpoint.model_weights(state), path, hint="or drop the model.* overrides"
    )
    model.to(env.device).eval()
    loss_fn = build(cfg.loss, "loss", _as_function=True)
    metrics = {name: build(m, f"metrics.{name}") for name, m in cfg.metrics.items()}
    autocast = autocast_for(cfg.trainer.precision, env.device)
    doing = [f"evaluating split {request.split}"]
    with (
        process_group(env, cfg.dist),
        translated(env.rank, cfg.dist.timeout_s, run.output_dir, doing),
    ):
        results = evaluate(model, split, env, loss_fn, metrics, autocast)  # collective
        if request.predict:
            doing[0] = f"predicting split {request.split}"
            predict(
                model, split, env, autocast, run.output_dir / f"predictions_{request.split}.pt",
                request.predict_key, request.predict_pad,
            )  # fmt: skip
    if env.is_main:
        record = {"checkpoint": str(path), "step": int(state.get("step", 0)), **results}
        jsonfile.write(
            run.output_dir / f"eval_{request.split}.json",
            {k: jsonfile.finite_or_none(v) for k, v in record.items()},
        )
        log.info(
            "%s %s at step %d: %s (%s)",
            request.split,
            path.name,
            record["step"],
            " ".join(f"{k} {v:.6g}" for k, v in results.items()),
            run.output_dir / f"eval_{request.split}.json",
        )
    return results
