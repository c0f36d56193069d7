"""Parallelism: where this process sits (`env`), the process group (`group`), the collectives
the loop and a user's loss or metric use (`collectives`), the wrapper the `ddp/` group chooses
(`ddp`, `fsdp`, `comm_hooks`), stopping on a signal (`preemption`, `torchrun`) and a rank's
failure as one line (`failures`). Starting the job is hydra_ddp/launch/; a user rarely edits
here.
"""

from hydra_ddp.distributed.collectives import (
    all_gather_floats,
    all_gather_objects,
    all_gather_with_grad,
    evaluation_batch,
    gather_for_metrics,
    sum_by_name,
)
from hydra_ddp.distributed.env import DistEnv, env_from_environ, share_cpus_in_submitit_task
from hydra_ddp.distributed.group import barrier, process_group, use_device

__all__ = [
    "DistEnv",
    "all_gather_floats",
    "all_gather_objects",
    "all_gather_with_grad",
    "barrier",
    "env_from_environ",
    "evaluation_batch",
    "gather_for_metrics",
    "process_group",
    "share_cpus_in_submitit_task",
    "sum_by_name",
    "use_device",
]
