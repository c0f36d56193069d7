"""What a launcher (torchrun, the elastic agent, submitit, the sweep plugins) put in the
environment, read without torch: a sweep's launching process asks too and runs no job. The
variables the engine and its Hydra plugins hand each other are named here, once.
"""

import os
import random

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

# Set by hydra/launcher=ray in each job's process: the job's number in the sweep.
RAY_JOB_ENV = "HYDRA_DDP_RAY_JOB"
# Set in a sweep job's process once it started: the sweep report tells a job that never ran.
JOB_STARTED_ENV = "HYDRA_DDP_JOB_STARTED"
# Set by hydra/sweeper=optuna_pruned for each trial: where it reports its evaluations.
OPTUNA_STORAGE_ENV = "HYDRA_DDP_OPTUNA_STORAGE"
OPTUNA_STUDY_ENV = "HYDRA_DDP_OPTUNA_STUDY"
OPTUNA_TRIAL_ENV = "HYDRA_DDP_OPTUNA_TRIAL"
# What schedulers and users send to stop a job or a sweep (SLURM's SIGTERM, Ctrl-C, submitit's
# and many sites' USR1/USR2): every rank checkpoints and stops; a sweep's process stops (under
# the basic and Ray launchers, with its jobs; submitit's jobs are the scheduler's).
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")
# What torch's agent forwards to its workers and waits for (torchrun's `--signals-to-handle`,
# the self-launch's LaunchConfig): torch's default, plus the USR signals the workers stop on.
AGENT_SIGNALS = ",".join((*STOP_SIGNALS, "SIGHUP", "SIGQUIT"))
# Set by the self-launch's agent: its workers start with SIGINT blocked (launch/interrupt.py).
SIGINT_HELD_ENV = "HYDRA_DDP_SIGINT_HELD"


def torchrun_worker() -> bool:
    """True in a worker that torchrun (or the self-launch's elastic agent) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def under_submitit() -> bool:
    """True in a job that submitit started (SLURM, or its local executor)."""
    return "SUBMITIT_EXECUTOR" in os.environ


def under_launcher() -> bool:
    """True when torchrun, torch's elastic agent or SLURM/submitit started this process."""
    return "RANK" in os.environ or submitit_tasks() > 1


def export_submitit_env() -> None:
    """In a submitit job of several tasks, export RANK/WORLD_SIZE/... as torchrun does."""
    if "RANK" in os.environ or submitit_tasks() <= 1:
        return
    from submitit import JobEnvironment
    from submitit.helpers import TorchDistributedEnvironment

    # A MASTER_ADDR / MASTER_PORT the user set is kept (submitit's export refuses to overwrite).
    given = {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT") if k in os.environ}
    # Keep every GPU visible: the device is picked from LOCAL_RANK, as under torchrun.
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    # submitit draws the port from 20000-60000, mostly inside Linux's ephemeral range
    # (32768-60999) where the kernel hands out ports to every socket bound to port 0 (gloo's
    # pair listeners, W&B's service, another job's clients): a job then finds its port taken.
    # Every task derives the same port from the job id, below that range.
    os.environ["MASTER_PORT"] = str(random.Random(JobEnvironment().job_id).randint(20000, 32767))
    os.environ.update(given)


def submitit_tasks() -> int:
    """The tasks of this submitit job (SLURM's or the local executor's); 0 outside one."""
    if not under_submitit():
        return 0
    try:
        from submitit import JobEnvironment

        return JobEnvironment().num_tasks
    except Exception:  # not inside a submitit job after all
        return 0


def launcher_rank() -> int:
    """This process's global rank as its launcher numbered it (0 with no launcher)."""
    for key in ("RANK", "SLURM_PROCID", "SUBMITIT_LOCAL_GLOBALID"):
        if key in os.environ:
            return int(os.environ[key])
    return 0
