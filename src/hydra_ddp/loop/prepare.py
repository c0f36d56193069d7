"""One rank's job, built in the order train.py calls it: `start_rank`, `build_data` and
`prepare` before any process group (bad input fails once per rank, before any rank waits for
another); `start_tracker` and `begin` once the group is up and the model wrapped.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

from hydra_ddp import redact
from hydra_ddp.callbacks import Callbacks
from hydra_ddp.checkpoint.init_from import for_fresh_run
from hydra_ddp.components import build
from hydra_ddp.config import TrainConfig, Wrapper
from hydra_ddp.data import EvalData, TrainData, check_source
from hydra_ddp.distributed import DistEnv, use_device
from hydra_ddp.loop.checkpointing import resume_point
from hydra_ddp.loop.evaluation import monitor_key
from hydra_ddp.loop.position import epoch_length
from hydra_ddp.rank_job import RankJob, build_components
from hydra_ddp.rundir import provenance
from hydra_ddp.tracking import RunInfo, Tracker
from hydra_ddp.tracking.console import Console

log = logging.getLogger(__name__)


def start_rank(cfg: TrainConfig, env: DistEnv) -> Console:
    """This rank's device, seed and determinism, and its console (other ranks quiet)."""
    console = Console(env, enabled=cfg.trainer.progress)
    console.quiet_other_ranks()
    use_device(env)
    monitor_key(cfg)  # trainer.monitor names a metric this job computes
    if cfg.trainer.deterministic:
        _make_deterministic()
    torch.manual_seed(cfg.trainer.seed)
    return console


def build_data(cfg: TrainConfig, env: DistEnv) -> tuple[TrainData, dict[str, EvalData]]:
    """The data source, and each split as this rank reads it: the sampling policy (sampler/)
    decides which training rows are this rank's and in what order each epoch."""
    tcfg = cfg.trainer
    source = build(cfg.data, "data")
    check_source(source)
    train_data = TrainData(
        source, cfg.sampler, env, tcfg.batch_size, cfg.sampler_seed, tcfg.num_workers
    )
    evals = {
        s: EvalData(source, s, train_data.policy, env, tcfg.batch_size, tcfg.num_workers)
        for s in ("val", "test")
    }
    return train_data, evals


def prepare(
    cfg: TrainConfig,
    env: DistEnv,
    run: RunInfo,
    console: Console,
    data: tuple[TrainData, dict[str, EvalData]],
) -> RankJob:
    """The rest of the rank's job: the user's components (the model on its device), the step
    counts, the callbacks, the resume point, trainer.init_from."""
    tcfg, (train_data, evals) = cfg.trainer, data
    per_epoch = epoch_length(train_data.micro_batches_per_epoch, tcfg)  # micro-batches
    # trainer.epochs counts passes over the data: its micro-batches, whatever grad_accum is;
    # the last step takes what is left (a smaller step) when they do not divide.
    total_micro = tcfg.epochs * per_epoch if tcfg.max_steps <= 0 else None
    total_steps = tcfg.max_steps if total_micro is None else -(-total_micro // tcfg.grad_accum)
    # The epochs the run starts (the last maybe in part), for an epoch-stepped schedule.
    epochs = -(-total_steps * tcfg.grad_accum // max(per_epoch, 1))
    components = build_components(cfg, train_data.source, env.device, total_steps, epochs)
    callbacks = Callbacks(cfg.callbacks, data=train_data.source)
    resume_from = resume_point(cfg, env, run, console)
    # Names and shapes checked here, before any group; ddp=fsdp2 loads into each rank's
    # shards after the wrap (loop/wrapping.py).
    init_sharded = for_fresh_run(
        components.model, tcfg.init_from, resume_from, init_map=tcfg.init_map,
        strict=tcfg.init_strict, sharded=cfg.ddp.wrapper == Wrapper.fsdp2,
    )  # fmt: skip
    return RankJob(
        cfg=cfg,
        env=env,
        run=run,
        console=console,
        components=components,
        train_data=train_data,
        evals=evals,
        micro_batches_per_epoch=per_epoch,
        total_steps=total_steps,
        total_epochs=epochs,
        total_micro=total_micro,
        callbacks=callbacks,
        resume_from=resume_from,
        init_sharded=init_sharded,
    )


def start_tracker(job: RankJob, resumed_step: int | None) -> Tracker:
    """Collective: the run's provenance (run.json), then the tracker's sinks (stats files,
    W&B, TensorBoard), continuing the resumed run's at `resumed_step` (None: a fresh run)."""
    cfg, env, run = job.cfg, job.env, job.run
    origin = provenance.record_run(
        run.output_dir, env, run.overrides, cfg.trainer.untracked_content
    )  # collective
    tracker = Tracker(cfg.logger, env, run, resumed_step=resumed_step)
    tracker.add_config({"provenance": origin} if origin else {})
    return tracker


def begin(job: RankJob, scope: contextlib.ExitStack) -> None:
    """Before the first step: the config and the plan said, and autograd's anomaly detection
    switched on for the job (on `scope`) under trainer.detect_anomaly."""
    job.console.show_config(redact.config(job.run.config))
    _log_plan(job)
    if job.cfg.trainer.detect_anomaly:
        log.warning("autograd anomaly detection is on (trainer.detect_anomaly): slow")
        scope.enter_context(torch.autograd.detect_anomaly())


def _log_plan(job: RankJob) -> None:
    data, env, tcfg = job.train_data, job.env, job.cfg.trainer
    log.info(
        "%d rank(s) | %d train rows held by rank %d (%.1f MiB) | %g steps/epoch | %d steps",
        env.world_size,
        data.rows_held,
        env.rank,
        data.bytes_held / 2**20,
        job.micro_batches_per_epoch / tcfg.grad_accum,
        job.total_steps,
    )
    per_rank = data.rows_per_rank  # strided: 1/world of the split; sharded: its own part
    if per_rank < tcfg.batch_size:
        log.warning(
            "trainer.batch_size=%d is more than the %d training rows each rank gets: every "
            "step sees the whole split (lower trainer.batch_size)",
            tcfg.batch_size,
            per_rank,
        )
    left = (job.total_micro or 0) % tcfg.grad_accum
    if left:
        log.info(
            "trainer.epochs=%d is %d micro-batches per rank: the last step accumulates %d of "
            "trainer.grad_accum=%d (a smaller step, not dropped)",
            tcfg.epochs, job.total_micro, left, tcfg.grad_accum,
        )  # fmt: skip


def _make_deterministic() -> None:
    """trainer.deterministic: the same result for the same inputs, at some cost in speed."""
    # cuBLAS reads it when its first handle is made, after this (the model is not built yet).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
