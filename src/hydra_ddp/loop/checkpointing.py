"""One job's checkpoints: where it resumes from (`resume_point`, before any process group), what
they hold (`checkpointed`, declared where the job is built), who writes them
(`checkpointer_for`), and the resume itself (`resume`, `finished_summary`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from hydra_ddp import tracking
from hydra_ddp.checkpoint import Checkpointer, checkpoint_dir, resolve_resume, state
from hydra_ddp.checkpoint.dcp import DCPCheckpointer
from hydra_ddp.checkpoint.reader import steps
from hydra_ddp.config import TrainConfig
from hydra_ddp.data import epoch_rows
from hydra_ddp.disk import before
from hydra_ddp.distributed import DistEnv, all_gather_objects
from hydra_ddp.errors import UserError
from hydra_ddp.loop.evaluation import Monitor, monitor_key
from hydra_ddp.loop.position import Counting, Position, PositionState
from hydra_ddp.loop.wrapping import Wrapped
from hydra_ddp.rank_job import RankJob
from hydra_ddp.rundir import jsonfile
from hydra_ddp.step import scaler_for
from hydra_ddp.tracking import RunInfo
from hydra_ddp.tracking.console import Console

log = logging.getLogger(__name__)


def resume_point(cfg: TrainConfig, env: DistEnv, run: RunInfo, console: Console) -> Path | None:
    """The checkpoint trainer.resume names in the output dir (None: a fresh run); under
    trainer.resume=never, rank 0 first sets the earlier run's checkpoints and stats aside."""
    folder = checkpoint_dir(run.output_dir)
    if folder.exists() and not folder.is_dir():  # refused before the job trains for nothing
        raise UserError(
            f"{folder} exists but is not a directory, so no checkpoint could be "
            "saved: move it away, or choose another hydra.run.dir"
        )
    if cfg.trainer.resume == "never" and cfg.trainer.init_from:
        weights = Path(cfg.trainer.init_from).resolve()
        run_dir, ckpts = Path(run.output_dir).resolve(), folder.resolve()
        if weights in (run_dir, ckpts) or ckpts in weights.parents:
            raise UserError(  # before anything moves: its weights would move away with the rest
                f"trainer.init_from={cfg.trainer.init_from} is in this run's checkpoints, which "
                "trainer.resume=never moves to checkpoints.before-<n>/: start the new run in "
                "another hydra.run.dir"
            )
    with console.said_by_main("hydra_ddp.checkpoint.reader"):  # "skipping <damaged>": once
        found = resolve_resume(cfg.trainer.resume, run.output_dir)
    if cfg.trainer.resume == "never" and env.is_main:
        set_aside_checkpoints(folder)
        tracking.set_aside_stats(run.output_dir)  # the stats files and summary.json
    elif cfg.trainer.resume != "auto" and found is not None and env.is_main:
        if found.parent.resolve() == folder.resolve():  # one of its own, named: going back
            set_aside_later_checkpoints(folder, found)
    return found


def set_aside_checkpoints(folder: Path) -> None:
    """Move the checkpoints of an earlier run to checkpoints.before-<n>/ (nothing made earlier
    is deleted), so the new run's rotation and a later resume see only its own."""
    if not folder.is_dir() or not any(folder.iterdir()):
        return
    aside = before(folder)
    folder.rename(aside)
    log.warning(
        "trainer.resume=never: the checkpoints already in %s were moved to %s", folder, aside
    )


def set_aside_later_checkpoints(folder: Path, found: Path) -> None:
    """Resuming from an earlier checkpoint of this run (trainer.resume=<one of its own>): its
    later ones move to checkpoints.before-<n>/, or the rotation, which keeps the highest steps,
    would delete each new checkpoint as it is written."""
    listed = steps(folder)
    taken = next((step for step, path in listed if path.resolve() == found.resolve()), None)
    later = [path for step, path in listed if taken is not None and step > taken]
    if not later:
        return
    aside = before(folder)
    aside.mkdir()
    for path in later:
        path.rename(aside / path.name)
    log.warning(
        "resuming from %s: the %d later checkpoint(s) of this run were moved to %s",
        found.name,
        len(later),
        aside,
    )


def checkpointed(job: RankJob, wrapped: Wrapped) -> state.CheckpointedObjects:
    """This job's checkpointed objects, around the wrapped model: the position starts at 0."""
    cfg, env = job.cfg, job.env
    return state.CheckpointedObjects(
        model=job.components.model,
        optimizers=job.components.optimizers,
        scaler=scaler_for(cfg.trainer.precision, env.device),
        ema=wrapped.ema,
        monitor=Monitor(cfg.trainer, monitor_key(cfg)),
        callbacks=job.callbacks,
        position=PositionState(Position(), _counting(job)),
        comm_hook=wrapped.hook_state,
        device=env.device,
        sharded=wrapped.sharded,
    )


def checkpointer_for(job: RankJob, objects: state.CheckpointedObjects) -> Checkpointer:
    """The job's checkpointer (ddp=fsdp2: sharded folders), holding the template's members and
    every callback's `checkpoint_members()`."""
    tcfg = job.cfg.trainer
    members = state.members(job.callbacks.checkpoint_members())
    kind = DCPCheckpointer if objects.sharded else Checkpointer
    common = dict(keep=tcfg.keep_ckpts, total_steps=job.total_steps, async_save=tcfg.async_ckpt)
    return kind(
        job.run.output_dir, job.env, objects, members, interval=tcfg.ckpt_interval, **common
    )


def resume(job: RankJob, checkpointer: Checkpointer) -> bool:
    """Collective: restore the checkpoint rank 0 picked (a lagging or node-local file system
    could show each rank another newest one) into every checkpoint member, the position with
    it; False when there is none to resume."""
    env, tcfg = job.env, job.cfg.trainer
    path = all_gather_objects(job.resume_from if env.is_main else None, env)[0]
    if path is None:
        # Different dropout masks per rank; the weights are already equal (same seed, and
        # DDP broadcasts rank 0's at construction).
        torch.manual_seed(tcfg.seed + env.rank)
        return False
    checkpointer.restore(path)
    return True


def finished_summary(job: RankJob, step: int) -> dict[str, Any] | None:
    """Collective: the earlier summary when the checkpoint resumed from (at `step`) already
    ends the run, else None. Rank 0 reads it and every rank returns the same, so no rank
    trains alone on an output dir that another node cannot see."""
    env, total_steps = job.env, job.total_steps
    path = job.run.output_dir / "summary.json"
    found = jsonfile.read(path) if step >= total_steps and env.is_main else None
    if found is None and step >= total_steps and env.is_main and path.exists():
        log.warning("%s is unreadable (not JSON): treated as absent, evaluated again", path)
    found = all_gather_objects(found, env)[0]
    if found is not None and env.is_main:
        log.info(
            "already complete at step %d of %d: nothing to do (%s); retrain with "
            "trainer.resume=never or in a new output dir",
            step,
            total_steps,
            path,
        )
    return found


def _counting(job: RankJob) -> Counting:
    cfg, env = job.cfg, job.env
    return Counting(
        world_size=env.world_size,
        batch_size=cfg.trainer.batch_size,
        sampler=epoch_rows.settings(cfg.sampler, cfg.sampler_seed),
        micro_batches_per_epoch=job.micro_batches_per_epoch,
        is_main=env.is_main,
        source=job.train_data.source,
        tcfg=cfg.trainer,
    )
