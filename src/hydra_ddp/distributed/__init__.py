"""Launching and the distributed environment.

- `env`: where this process sits (`DistEnv`), read once from what torchrun, the elastic agent or
  SLURM set; `group`: the process group's start, bounds and teardown; `collectives`: the few
  collectives the loop uses, `all_gather_with_grad` for a loss that needs every rank's rows and
  `gather_for_metrics` for a metric that does.
- `ddp`, `fsdp`: the data-parallel wrapper the `ddp/` group chooses (DDP or FSDP2).
- `comm_hooks`: DDP's gradient compression hooks, by name.
- `entry`: the command line's way in (`hydra_ddp.train.main` hands over to `entry.main`): checks,
  Hydra, the self-launch or a rank's job here, and every way a job ends as an exit code.
- `launch`, `torchrun`: `python -m hydra_ddp.train dist.nproc_per_node=N` without torchrun, and
  the elastic agent's signals and logs; `preemption`: a stop signal ends in a checkpoint.

What a job writes beside its checkpoints (claim, paths, `run.json`, side files, the sweep report)
lives in `hydra_ddp.rundir`.

A user rarely edits here; what they call is re-exported below (`hydra_ddp.distributed.DistEnv`,
`hydra_ddp.distributed.all_gather_with_grad`, `hydra_ddp.distributed.export_submitit_env`).
"""

from hydra_ddp.distributed.collectives import (
    all_gather_floats,
    all_gather_objects,
    all_gather_with_grad,
    all_reduce_sum,
    evaluation_batch,
    gather_for_metrics,
    sum_by_name,
)
from hydra_ddp.distributed.env import (
    DistEnv,
    backend_for,
    env_from_environ,
    export_submitit_env,
    launcher_rank,
    share_cpus_in_submitit_task,
    under_launcher,
)
from hydra_ddp.distributed.group import barrier, destroy_process_group, process_group, use_device

__all__ = [
    "DistEnv",
    "all_gather_floats",
    "all_gather_objects",
    "all_gather_with_grad",
    "all_reduce_sum",
    "backend_for",
    "barrier",
    "destroy_process_group",
    "env_from_environ",
    "evaluation_batch",
    "export_submitit_env",
    "gather_for_metrics",
    "launcher_rank",
    "process_group",
    "share_cpus_in_submitit_task",
    "sum_by_name",
    "under_launcher",
    "use_device",
]
