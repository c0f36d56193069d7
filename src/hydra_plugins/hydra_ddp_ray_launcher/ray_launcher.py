"""The Hydra launcher; the work is in _sweep.py, imported on launch only (the plugin scan imports
this module on every start)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class RayLauncher(Launcher):
    def __init__(self, **params: Any) -> None:
        self.params = params
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None
        self.task_function: Optional[TaskFunction] = None
        self.where = ""  # the Ray the sweep runs on, in words
        self.stop_file = ""
        self.stop: Any = None  # _sweep.StopRequests

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function
        # Before Hydra composes and checks every job of the batch.
        from hydra_plugins.hydra_ddp_ray_launcher import _sweep

        _sweep.prepare(self)

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        from hydra_plugins.hydra_ddp_ray_launcher import _sweep

        return _sweep.launch(self, job_overrides, initial_job_idx)
