"""The Hydra launcher and its `hydra.launcher` keys, every default; the work is in _sweep.py,
imported on launch only (the plugin scan imports this module on every start: no Ray here). No
`from __future__ import annotations`: the scan loads it outside sys.modules, where a dataclass
cannot resolve them."""

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


@dataclass
class RayLauncherConf:
    _target_: str = "hydra_plugins.hydra_ddp_ray_launcher.ray_launcher.RayLauncher"
    # Where the jobs run. null: a Ray started by the sweep on this machine and stopped at its
    # end. `auto`: the Ray cluster this machine belongs to (`ray start --head` / `ray start
    # --address=...`), left running; or a cluster's address, `host:6379`.
    address: Optional[str] = None
    # CPUs each job asks Ray for (its ranks' share; each rank gets cpus_per_job /
    # dist.nproc_per_node OpenMP threads). null: dist.nproc_per_node, one core per rank.
    cpus_per_job: Optional[float] = None
    # GPUs each job asks for. null: dist.nproc_per_node when the cluster has GPUs and
    # dist.device is not cpu, else 0. Each job sees only the GPUs Ray gives it
    # (CUDA_VISIBLE_DEVICES).
    gpus_per_job: Optional[float] = None
    # A sweep-started Ray: the CPUs and GPUs it may hand out (null: all of this machine's).
    num_cpus: Optional[int] = None
    num_gpus: Optional[int] = None
    # After a stop signal to the sweep (Ctrl-C, SIGTERM, SIGUSR1, SIGUSR2): seconds each running
    # job gets to save its checkpoint and stop before it is killed.
    stop_grace_s: float = 60.0
    # More keyword arguments of ray.init (a sweep-started Ray), e.g. {object_store_memory: ...}.
    init: Dict[str, Any] = field(default_factory=dict)
    # Accepted so that a command line that sets them still runs, and ignored with a warning:
    # every job starts as a fresh interpreter, and no process outlives the sweep.
    warm_start: Optional[bool] = None
    warm_idle_s: Optional[float] = None


ConfigStore.instance().store(
    group="hydra/launcher", name="hydra_ddp_ray", node=RayLauncherConf, provider="hydra_ddp"
)


class RayLauncher(Launcher):
    def __init__(self, **params: Any) -> None:
        self.params = params
        self.grace_s = float(params["stop_grace_s"])
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
