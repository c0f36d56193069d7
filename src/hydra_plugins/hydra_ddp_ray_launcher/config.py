"""The schema of `hydra.launcher` for `hydra/launcher=ray`, every default. No Ray import: the
plugin scan imports this on every start."""

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore


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
