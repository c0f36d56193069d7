"""The Hydra sweeper object; the work is in _study.py (imported when the sweep starts: Optuna
loads in seconds, and Hydra's plugin scan imports this module on every start)."""

from __future__ import annotations

from typing import Any, List, Optional

from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class PrunedOptunaSweeper(Sweeper):
    """Optuna's ask and tell around the launcher, with each job told its trial (see the
    package's docstring)."""

    def __init__(self, **params: Any) -> None:
        self.params = params
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None
        self.launcher: Any = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )

    def sweep(self, arguments: List[str]) -> None:
        from hydra_plugins.hydra_ddp_optuna_pruned import _study

        _study.sweep(self, arguments)
