"""A job that is one trial of a pruning Optuna sweep (`hydra/sweeper=optuna_pruned`): it
reports the monitored metric at every evaluation and stops when the study's pruner says so.

The sweeper names the study's storage, the study and the job's trial in three variables of
`hydra.job.env_set`. Global rank 0 alone reports, through Optuna's `Trial`; the others follow
its decision. A pruned job ends like an early stop and marks its trial with the step.
"""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING, Any

from hydra_ddp.launcher_env import OPTUNA_STORAGE_ENV as STORAGE_ENV
from hydra_ddp.launcher_env import OPTUNA_STUDY_ENV as STUDY_ENV
from hydra_ddp.launcher_env import OPTUNA_TRIAL_ENV as TRIAL_ENV

if TYPE_CHECKING:
    from hydra_ddp.distributed import DistEnv

# Study attribute: the pruner's config (`_target_` and arguments), set by the sweeper, so each
# job builds the same pruner (Optuna keeps the pruner out of the storage).
PRUNER_ATTR = "pruner"
# Trial attribute, set by the job that was pruned: the step it stopped at.
PRUNED_ATTR = "pruned_at_step"


class Pruning:
    """Collective: the trial's side of a pruning sweep, on every rank (a no-op outside one)."""

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
        # Here, not at the top: the sweeper reads this module's names in a sweep's launching
        # process, which runs no job and so never imports torch.
        from hydra_ddp.distributed import all_gather_objects

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
