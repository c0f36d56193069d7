"""The Hydra sweeper and its `hydra.sweeper` keys, every default. The plugin scan imports this on
every start, with or without Optuna (_study.py imports it). No `from __future__ import
annotations`: the scan loads it outside sys.modules, where a dataclass cannot resolve them."""

import importlib.util
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, NoReturn, Optional

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from hydra_ddp import redact
from hydra_ddp.errors import UserError


@dataclass
class OptunaSweeperConf:
    _target_: str = "hydra_plugins.hydra_ddp_optuna.sweeper.OptunaSweeper"
    # Sampler, pruner and storage reach the sweeper as configs, from which the jobs build theirs.
    _recursive_: bool = False
    # minimize or maximize: must agree with trainer.monitor_mode (min or max).
    direction: str = "minimize"
    # Where the study lives: an Optuna RDB URL (sqlite:///..., postgresql://user@host/db), or
    # an Optuna storage as `_target_` + arguments (a JournalStorage on a shared file system:
    # docs/sweeps.md). null: sqlite:///<sweep dir>/optuna.db.
    storage: Any = None
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
    # null: every trial runs to its end. Any optuna.pruners class (`_target_` + its arguments):
    # each job reports trainer.monitor at its evaluations and stops when the pruner says so;
    # conf/hydra/sweeper/pruner/ holds median and successive_halving.
    pruner: Any = None
    # The search space, in Hydra's override syntax (choice, range, interval, tag(log, ...), or
    # a comma list); a plain value is a fixed override of every job.
    params: Dict[str, str] = field(default_factory=dict)


ConfigStore.instance().store(
    group="hydra/sweeper", name="hydra_ddp_optuna", node=OptunaSweeperConf, provider="hydra_ddp"
)


class OptunaSweeper(Sweeper):
    def __init__(self, **params: Any) -> None:
        self.params = OmegaConf.to_container(OmegaConf.create(params), resolve=True)
        self.config: Optional[DictConfig] = None
        self.launcher: Any = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        if importlib.util.find_spec("optuna") is None:  # installed without the `sweep` extra
            choices = OmegaConf.select(config, "hydra.runtime.choices", default={})
            group = "hparams_search" if choices.get("hparams_search") else "hydra/sweeper"
            chosen = f"{group}={choices.get(group)}"
            refuse(f'{chosen} needs Optuna: pip install -e ".[sweep]" (or "optuna>=4")')
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )

    def sweep(self, arguments: List[str]) -> None:
        from hydra_plugins.hydra_ddp_optuna import _study

        try:
            _study.sweep(self, arguments)
        except UserError as e:
            refuse(str(e))


def refuse(message: str) -> NoReturn:
    sys.stderr.write(redact.pairs(f"error: {message}") + "\n")
    sys.exit(2)
