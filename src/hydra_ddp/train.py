"""One rank's training job, top to bottom, and the command that runs it on every rank.

    torchrun --standalone --nproc_per_node=2 -m hydra_ddp.train            # torchrun starts ranks
    python -m hydra_ddp.train dist.nproc_per_node=2                        # the job starts them
    python -m hydra_ddp.train -m dist.nproc_per_node=2 model=mlp,cnn       # a sweep of DDP jobs

`main` composes the config and runs `train` on each rank (the checks before launch, the
launchers and the exit codes are hydra_ddp/launch/'s). `train` is the design, each step a call
into the module that owns it. A call marked `# collective` must be reached by every rank at the
same step; putting one under `if env.is_main:` hangs the job.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

# First, before torch: a Ctrl-C while a launched worker imports exits quietly (interrupt.py).
import hydra_ddp.launch.interrupt  # noqa: F401
from hydra_ddp.launch.command import run_command

if TYPE_CHECKING:
    from hydra_ddp.config import TrainConfig
    from hydra_ddp.distributed import DistEnv
    from hydra_ddp.rank_job import RankJob
    from hydra_ddp.tracking import RunInfo


def main(config_path: str | None = None, config_name: str = "train") -> None:
    """`python -m hydra_ddp.train`, the `hydra-ddp-train` command, and a thin project's entry:
    compose `config_name` from `config_path` (None: the engine's conf/) and the command line,
    run `train` on every rank, and exit with the job's status."""
    run_command(train, config_path, config_name)


def train(cfg: TrainConfig, env: DistEnv, run: RunInfo) -> dict[str, Any]:
    """One rank's share of the job; returns the job summary (the same on every rank)."""
    # The job's modules (torch among them) are imported where a job runs, not with this file:
    # a sweep's launching process (`-m` on Ray or SLURM) imports it, and starts faster without.
    from hydra_ddp.distributed import process_group
    from hydra_ddp.distributed.failures import translated
    from hydra_ddp.distributed.preemption import exit_with_parent
    from hydra_ddp.loop.prepare import build_data, prepare, start_rank

    # Before any process group, so bad input fails once per rank, before any rank waits.
    console = start_rank(cfg, env)  # device, seed, determinism; other ranks quiet
    # The data and its sampling policy, then the model, loss, optimizers, callbacks and resume
    # point. Nothing of it stays in this frame.
    jobs = [prepare(cfg, env, run, console, build_data(cfg, env))]
    if env.launched:
        exit_with_parent()
    # The process group, from what the launcher set (torchrun, the self-launch, SLURM).
    with process_group(env, cfg.dist), translated(env.rank, cfg.dist.timeout_s, run.output_dir):
        # Handed over, not kept here: under ddp=fsdp2 the model and optimizer state are sharded
        # DTensors that hold the process group (their device mesh), so they must die in
        # `_train_in_group`, before the group (see distributed/group.py).
        return _train_in_group(jobs.pop())


def _train_in_group(job: RankJob) -> dict[str, Any]:
    """Everything after the process group is up; the wrapped model dies with its frame."""
    from hydra_ddp.loop.checkpointing import (
        checkpointed,
        checkpointer_for,
        finished_summary,
        resume,
    )
    from hydra_ddp.loop.fit import build_loop, finish_run, fit
    from hydra_ddp.loop.prepare import begin, start_tracker
    from hydra_ddp.loop.wrapping import wrap_job

    wrapped = wrap_job(job)  # collective: DDP or FSDP2 (ddp.wrapper), the EMA, torch.compile
    objects = checkpointed(job, wrapped)  # the objects a checkpoint holds; the position at 0
    checkpointer = checkpointer_for(job, objects)  # with the template's and callbacks' members
    resumed = resume(job, checkpointer)  # collective
    step = objects.position.pos.step
    if resumed and (done := finished_summary(job, step)) is not None:  # collective
        return done
    tracker = start_tracker(job, step if resumed else None)  # collective
    with tracker, contextlib.ExitStack() as scope:
        scope.callback(checkpointer.abandon)  # a failed job leaves no half-written save
        begin(job, scope)  # the config and the plan said
        loop = build_loop(job, wrapped, objects, checkpointer, tracker, scope)
        wall = fit(loop)  # collective: the steps, evaluation and checkpoints on their cadence
        # Collective: the last validation and checkpoint, test, this rank's stats, the summary.
        return finish_run(loop, step, wall)


if __name__ == "__main__":
    main()
