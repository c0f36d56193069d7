"""Launching and the distributed environment.

- `env`: where this process sits (`DistEnv`), read once from what torchrun, the elastic agent or
  SLURM set (`launcher_env` reads those variables without torch); `group`: the process group's
  start, bounds and teardown; `collectives`: the few collectives the loop uses,
  `all_gather_with_grad` for a loss that needs every rank's rows and `gather_for_metrics` for a
  metric that does.
- `ddp`, `fsdp`: the data-parallel wrapper the `ddp/` group chooses (DDP or FSDP2).
- `comm_hooks`: DDP's gradient compression hooks, by name.
- `entry`: the command line's way in (`hydra_ddp.train.main` hands over to `entry.main`): checks
  and Hydra, without torch (a sweep's launching process runs no job); `run_job`: one job where
  it runs, the self-launch or a rank's job here, and every way a job ends as an exit code.
- `launch`, `torchrun`: `python -m hydra_ddp.train dist.nproc_per_node=N` without torchrun, and
  the elastic agent's signals and logs; `preemption`: a stop signal ends in a checkpoint.

What a job writes beside its checkpoints (claim, paths, `run.json`, side files, the sweep report)
lives in `hydra_ddp.rundir`.

A user rarely edits here; what they call is re-exported below, each name loaded on first use
(`hydra_ddp.distributed.DistEnv`, `hydra_ddp.distributed.all_gather_with_grad`,
`hydra_ddp.distributed.export_submitit_env`).
"""

from typing import TYPE_CHECKING

from hydra_ddp.lazy_names import lazy_names

# Each name loads its module on first use: a sweep's launching process reads the launcher's
# variables here but runs no job, so it never imports torch (see lazy_names.py).
__getattr__ = lazy_names(
    __name__,
    {
        "collectives": [
            "all_gather_floats",
            "all_gather_objects",
            "all_gather_with_grad",
            "all_reduce_sum",
            "evaluation_batch",
            "gather_for_metrics",
            "sum_by_name",
        ],
        "env": ["DistEnv", "backend_for", "env_from_environ", "share_cpus_in_submitit_task"],
        "launcher_env": ["export_submitit_env", "launcher_rank", "under_launcher"],
        "group": ["barrier", "destroy_process_group", "process_group", "use_device"],
    },
)

if TYPE_CHECKING:  # the same names, for type checkers and an editor's "go to definition"
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
    from hydra_ddp.distributed.group import (
        barrier,
        destroy_process_group,
        process_group,
        use_device,
    )
    from hydra_ddp.distributed.launcher_env import (
        export_submitit_env,
        launcher_rank,
        under_launcher,
    )

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
