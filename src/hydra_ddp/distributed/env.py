"""Where this process sits in the job: a rank's `DistEnv`, built once from the variables a
launcher (torchrun, the elastic agent, SLURM through submitit) set, and passed explicitly to
everything else. With none of them set the job is one process with no process group.
"""

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hydra_ddp.config import Device, DistConfig
from hydra_ddp.errors import UserError
from hydra_ddp.launcher_env import LAUNCHER_VARS, submitit_tasks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job. Cheap to build; no process group needed."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    # A launcher (torchrun, the elastic agent, SLURM) started this process: it gets a process
    # group and a DDP wrap even when it is the only rank, so one GPU runs the same code as 64.
    launched: bool = False

    @property
    def is_main(self) -> bool:
        """Global rank 0: the one process that writes shared files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when a process group is up (init_process_group ran)."""
        return dist.is_available() and dist.is_initialized()


def share_cpus_in_submitit_task(cpus_per_task: int | None) -> int | None:
    """Inside a submitit task (one rank) whose OMP_NUM_THREADS nobody set: give its OpenMP pool
    its CPU share, as torchrun does (SLURM's cpus-per-task, else the launcher's
    `cpus_per_task`, else the cores over the job's tasks): full pools in tasks side by side
    fight over the cores. Returns the threads set, or None."""
    if "SUBMITIT_EXECUTOR" not in os.environ or "OMP_NUM_THREADS" in os.environ:
        return None
    share = int(os.environ.get("SLURM_CPUS_PER_TASK") or cpus_per_task or 0)
    if share < 1:
        share = max(1, (os.cpu_count() or 1) // max(1, submitit_tasks()))
    os.environ["OMP_NUM_THREADS"] = str(share)  # for the processes it starts (data workers)
    torch.set_num_threads(share)
    return share


def env_from_environ(cfg: DistConfig) -> DistEnv:
    """Read the launcher's variables and pick this rank's device."""
    present = [k for k in LAUNCHER_VARS if k in os.environ]
    if not present:
        return DistEnv(device=_pick_device(cfg, local_rank=0))
    missing = [k for k in LAUNCHER_VARS if k not in os.environ]
    if missing:
        raise UserError(
            f"the environment sets {', '.join(present)} but not {', '.join(missing)}: start the "
            "job with torchrun (or set all of RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, "
            "MASTER_PORT)"
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        device=_pick_device(cfg, local_rank),
        launched=True,
    )


def _pick_device(cfg: DistConfig, local_rank: int) -> torch.device:
    want_cuda = cfg.device == Device.cuda or (
        cfg.device == Device.auto and torch.cuda.is_available()
    )
    if not want_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError(
            "dist.device=cuda but CUDA is not available here: use dist.device=cpu or auto"
        )
    count = torch.cuda.device_count()
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if count == 1 and local_rank > 0 and len(visible) == 1:
        # SLURM's --gpus-per-task=1 (or a binding script) shows each task only its own GPU.
        return torch.device("cuda", 0)
    if local_rank >= count:
        raise UserError(
            f"local rank {local_rank} has no GPU: this node has {count} visible GPU(s) but more "
            "processes per node were started; set --nproc_per_node (or dist.nproc_per_node) to "
            f"at most {count}, or use dist.device=cpu"
        )
    return torch.device("cuda", local_rank)
