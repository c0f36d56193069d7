"""Parallelism: where this process sits, the process group, and the data-parallel wrappers.

- `env`: this rank's `DistEnv` (rank, local rank, world size, device), built once from what
  torchrun, the elastic agent or SLURM set (hydra_ddp/launcher_env.py reads those variables);
- `group`: the process group's start, bounds and teardown;
- `collectives`: the few collectives the loop uses, `all_gather_with_grad` for a loss that
  needs every rank's rows and `gather_for_metrics` for a metric that does;
- `ddp`, `fsdp`, `comm_hooks`: the wrapper the `ddp/` group chooses (DDP with its comm hook, or
  FSDP2);
- `preemption`: a stop signal ends every rank at the same step with a checkpoint; `torchrun`:
  `python -m hydra_ddp.distributed.torchrun`, torchrun whose stop on a signal exits like its
  workers.

Starting the job (the command line, Hydra, the self-launch) is hydra_ddp/launch/; a user rarely
edits here.
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
    share_cpus_in_submitit_task,
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
    "gather_for_metrics",
    "process_group",
    "share_cpus_in_submitit_task",
    "sum_by_name",
    "use_device",
]
