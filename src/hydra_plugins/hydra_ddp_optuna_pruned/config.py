"""The schema of `hydra.sweeper` for `hydra/sweeper=optuna_pruned` (every default is here;
conf/hydra/sweeper/optuna_pruned.yaml adds the choice of pruner). Imported by Hydra's plugin
scan: no Optuna import here."""

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore


class Direction(Enum):
    minimize = 1
    maximize = 2


@dataclass
class PrunedOptunaSweeperConf:
    _target_: str = "hydra_plugins.hydra_ddp_optuna_pruned.sweeper.PrunedOptunaSweeper"
    # The sampler and the pruner reach the sweeper as configs: the jobs build the same pruner.
    _recursive_: bool = False
    # Must agree with trainer.monitor_mode (min: minimize, max: maximize).
    direction: Direction = Direction.minimize
    # The study's database, any Optuna RDB URL (sqlite:///..., postgresql://..., mysql://...).
    # null: sqlite:///<sweep dir>/optuna.db. Use a server database when the jobs run on
    # other machines than the sweep (SQLite over NFS locks badly).
    storage: Optional[str] = None
    # The same name and storage continue the study: its finished trials count, a trial the
    # stopped sweep left running is run again in its dir (it resumes from its checkpoint).
    study_name: str = "hydra_ddp"
    # Trials of the whole study, not of this run of the sweep: a continued sweep runs the rest.
    n_trials: int = 20
    # Trials asked for and launched at once (hydra/launcher=ray runs them side by side).
    n_jobs: int = 1
    sampler: Any = field(
        default_factory=lambda: {"_target_": "optuna.samplers.TPESampler", "seed": None}
    )
    # Any optuna.pruners class (`_target_` + its arguments); conf/hydra/sweeper/pruner/ holds
    # median and successive_halving.
    pruner: Any = field(default_factory=lambda: {"_target_": "optuna.pruners.MedianPruner"})
    # The search space, in Hydra's override syntax (choice, range, interval, tag(log, ...)).
    params: Dict[str, str] = field(default_factory=dict)


ConfigStore.instance().store(
    group="hydra/sweeper",
    name="hydra_ddp_optuna_pruned",
    node=PrunedOptunaSweeperConf,
    provider="hydra_ddp",
)
