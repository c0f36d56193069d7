"""A job that is one trial of a pruning Optuna sweep (`hydra/sweeper=optuna_pruned`): it
reports the monitored metric at every evaluation and stops when the study's pruner says so.

The sweeper (src/hydra_plugins/hydra_ddp_optuna_pruned) hands each job three variables,
through Hydra's `hydra.job.env_set`, so that every process of the job (the self-launched ranks,
submitit's tasks, a Ray task's process) inherits them: the study's database URL, its name and
the job's trial number. Global rank 0 alone talks to the database; the others get its decision,
as they get the monitor's (monitor.py). A pruned job ends like an early stop: its checkpoint,
the test split, summary.json (`pruned: true`), and the trial's `pruned_at_step` attribute,
from which the sweeper tells Optuna the trial was pruned.
"""

from __future__ import annotations

import logging
import math
import os
from typing import TYPE_CHECKING

from hydra_ddp.launcher_env import OPTUNA_STORAGE_ENV as STORAGE_ENV
from hydra_ddp.launcher_env import OPTUNA_STUDY_ENV as STUDY_ENV
from hydra_ddp.launcher_env import OPTUNA_TRIAL_ENV as TRIAL_ENV

if TYPE_CHECKING:
    from hydra_ddp.distributed import DistEnv

log = logging.getLogger(__name__)

# Study attribute: the pruner's config (`_target_` and arguments), set by the sweeper, so each
# job builds the same pruner (Optuna keeps the pruner out of the database).
PRUNER_ATTR = "pruner"
# Trial attribute, set by the job that was pruned: the step it stopped at.
PRUNED_ATTR = "pruned_at_step"


class Trial:
    """This job's trial, on global rank 0: report a value at a step, ask whether to stop."""

    def __init__(self, storage_url: str, study_name: str, number: int) -> None:
        import optuna
        from hydra.utils import instantiate

        self.number = number
        self.storage = optuna.storages.RDBStorage(storage_url)
        study_id = self.storage.get_study_id_from_name(study_name)
        pruner_cfg = self.storage.get_study_user_attrs(study_id).get(PRUNER_ATTR)
        pruner = instantiate(pruner_cfg) if pruner_cfg else optuna.pruners.MedianPruner()
        self.study = optuna.load_study(study_name=study_name, storage=self.storage, pruner=pruner)
        self.trial_id = self.storage.get_trial_id_from_study_id_trial_number(study_id, number)

    def should_prune(self, step: int, value: float) -> bool:
        """Record `value` at `step` as the trial's intermediate value; True when the pruner
        stops the trial there (it is then marked with the step)."""
        # NaN is what the pruners expect of a diverged run: they prune it.
        value = float(value) if math.isfinite(value) else float("nan")
        self.storage.set_trial_intermediate_value(self.trial_id, step, value)
        pruned = bool(self.study.pruner.prune(self.study, self.storage.get_trial(self.trial_id)))
        if pruned:
            self.storage.set_trial_user_attr(self.trial_id, PRUNED_ATTR, step)
        return pruned


class Pruning:
    """Collective: the trial's side of a pruning sweep, on every rank (a no-op outside one)."""

    def __init__(self, env: DistEnv) -> None:
        self.env = env
        self.trial: Trial | None = None
        self.active = TRIAL_ENV in os.environ
        if self.active and env.is_main:
            self.trial = Trial(
                os.environ[STORAGE_ENV], os.environ[STUDY_ENV], int(os.environ[TRIAL_ENV])
            )

    def should_prune(self, step: int, value: float) -> bool:
        """Collective: report `value` at `step`; True on every rank when rank 0's pruner
        stops the trial."""
        if not self.active:
            return False
        pruned = self.trial.should_prune(step, value) if self.trial is not None else False
        # Here, not at the top: the sweeper reads this module's names in a sweep's launching
        # process, which runs no job and so never imports torch.
        from hydra_ddp.distributed import all_gather_objects

        # One rank alone stopping would leave the others waiting in a collective: rank 0's
        # decision is everyone's (the same path as the monitor's).
        return bool(all_gather_objects(pruned, self.env)[0])
