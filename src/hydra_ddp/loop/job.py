"""One rank's training job: build the parts, resume, then the loop (fit.py) and its end.

`train(cfg, env, run)` is the whole job of one rank, the same on every rank (torchrun's, the
self-launched workers', a submitit task's, or the single process of `python -m
hydra_ddp.train`). `prepare` builds everything that can fail on bad input before any process
group; `_run` wraps the model, builds the checkpoint members (checkpoint.state) and the loop,
resumes, and hands over to `fit.fit` and `fit.finish_run`.

A call marked `# collective` must be reached by every rank at the same step (it talks to the
other ranks); putting one under `if env.is_main:` hangs the job.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import torch

from hydra_ddp import checkpoint, tracking
from hydra_ddp.callbacks import Callbacks, Context
from hydra_ddp.checkpoint import Checkpointer, state
from hydra_ddp.checkpoint.dcp import DCPCheckpointer
from hydra_ddp.checkpoint.files import check_folder
from hydra_ddp.checkpoint.init_from import apply, plan
from hydra_ddp.checkpoint.weights import open_weights
from hydra_ddp.components import build
from hydra_ddp.config import NanPolicy, TrainConfig, Wrapper
from hydra_ddp.data import EvalData, TrainData, check_source, epoch_rows
from hydra_ddp.distributed import DistEnv, all_gather_objects, process_group, use_device
from hydra_ddp.distributed.ddp import wrap_model
from hydra_ddp.distributed.preemption import (
    StopOnSignal,
    exit_with_parent,
)
from hydra_ddp.errors import translated
from hydra_ddp.loop.ema import EMA
from hydra_ddp.loop.evaluation import Evaluator
from hydra_ddp.loop.fit import Loop, finish_run, fit
from hydra_ddp.loop.job_types import Job, build_components
from hydra_ddp.loop.monitor import Monitor, monitor_key
from hydra_ddp.loop.position import Counting, Position, PositionState, epoch_length
from hydra_ddp.loop.profiling import step_profiler
from hydra_ddp.loop.pruning import Pruning
from hydra_ddp.optim import Optimizers
from hydra_ddp.rundir import jsonfile, provenance
from hydra_ddp.step import NonFiniteCheck, StepTools, autocast_for, scaler_for
from hydra_ddp.tracking import RunInfo, Tracker, make_tracker, redact
from hydra_ddp.tracking.console import Console
from hydra_ddp.tracking.stats import StepStats

log = logging.getLogger(__name__)


def prepare(cfg: TrainConfig, env: DistEnv, run: RunInfo) -> Job:
    tcfg = cfg.trainer
    console = Console(env, enabled=tcfg.progress)
    console.quiet_other_ranks()
    use_device(env)
    monitor_key(cfg)  # trainer.monitor names a metric this job computes
    if tcfg.deterministic:
        _make_deterministic()
    torch.manual_seed(tcfg.seed)
    source = build(cfg.data, "data")
    check_source(source)
    train_data = TrainData(
        source, cfg.sampler, env, tcfg.batch_size, cfg.sampler_seed, tcfg.num_workers
    )
    evals = {
        s: EvalData(source, s, train_data.policy, env, tcfg.batch_size, tcfg.num_workers)
        for s in ("val", "test")
    }
    per_epoch = epoch_length(train_data.micro_batches_per_epoch, tcfg)  # micro-batches
    # trainer.epochs counts passes over the data: its micro-batches, whatever grad_accum is;
    # the last step takes what is left (a smaller step) when they do not divide.
    total_micro = tcfg.epochs * per_epoch if tcfg.max_steps <= 0 else None
    total_steps = tcfg.max_steps if total_micro is None else -(-total_micro // tcfg.grad_accum)
    total_epochs = _total_epochs(total_steps, tcfg.grad_accum, per_epoch)
    parts = build_components(cfg, source, env.device, total_steps, total_epochs)
    callbacks = Callbacks(cfg.callbacks, data=source)
    check_folder(run.output_dir)
    with console.said_by_main("hydra_ddp.checkpoint.files"):  # "skipping <damaged>": once
        resume_from = checkpoint.resolve_resume(tcfg.resume, run.output_dir)
    if tcfg.resume == "never" and env.is_main:
        checkpoint.set_aside_checkpoints(run.output_dir)
        tracking.set_aside_stats(run.output_dir)  # the stats files and summary.json
    init_sharded = None
    if tcfg.init_from and resume_from is None:  # names and shapes checked here, before any group
        weights = open_weights(tcfg.init_from)
        init_sharded = plan(parts.model, weights, tcfg.init_map, tcfg.init_strict)
        if cfg.ddp.wrapper != Wrapper.fsdp2:  # fsdp2: into each rank's shards, after the wrap
            apply(parts.model, init_sharded)
            init_sharded = None
    elif tcfg.init_from:
        log.info("trainer.init_from=%s not used: resuming %s", tcfg.init_from, resume_from)
    return Job(
        cfg=cfg,
        env=env,
        run=run,
        console=console,
        components=parts,
        train_data=train_data,
        evals=evals,
        micro_batches_per_epoch=per_epoch,
        total_steps=total_steps,
        total_micro=total_micro,
        callbacks=callbacks,
        resume_from=resume_from,
        init_sharded=init_sharded,
    )


def train(cfg: TrainConfig, env: DistEnv, run: RunInfo) -> dict[str, Any]:
    """Run one rank's share of the job and return the job summary (the same on every rank)."""
    jobs = [prepare(cfg, env, run)]
    if env.launched:
        exit_with_parent()
    with process_group(env, cfg.dist), translated(env.rank, cfg.dist.timeout_s, run.output_dir):
        # Handed over, not kept here: under ddp=fsdp2 the job's model and optimizer state are
        # sharded DTensors that hold the process group (their device mesh), so they must die
        # in _run, before the group (see dist.process_group).
        return _run(jobs.pop())


def _run(job: Job) -> dict[str, Any]:
    """Everything after the process group is up. Its frame holds the DDP wrapper, which so dies
    when it returns, before the process group (see dist.process_group)."""
    cfg, env, run, parts = job.cfg, job.env, job.run, job.components
    tcfg = cfg.trainer
    sharded = cfg.ddp.wrapper == Wrapper.fsdp2
    # Before the wrap: ddp=fsdp2 shards the average like the model (its first update copies
    # the weights, so what it starts from does not matter).
    ema = EMA(parts.model, tcfg.ema_decay) if tcfg.ema_decay else None
    model, hook_state = wrap_model(
        parts.model, env, cfg.ddp, also=[ema.module] if ema and sharded else (),
        compile_units=tcfg.compile and sharded,
    )  # fmt: skip
    if job.init_sharded is not None:
        apply(parts.model, job.init_sharded, env.distributed)  # collective
    if sharded:  # fully_shard replaced the parameters: the optimizers must hold the new ones
        parts.optimizers = Optimizers.build(
            cfg.optim, cfg.scheduler, model, job.total_steps,
            _total_epochs(job.total_steps, tcfg.grad_accum, job.micro_batches_per_epoch),
            ["loss", *cfg.metrics],
        )  # fmt: skip
    # Compiled after the DDP wrap, as torch's DDP docs recommend: dynamo's DDPOptimizer then
    # splits the graph at DDP's bucket boundaries, so each bucket's all-reduce still starts
    # while the backward of the earlier layers runs (fsdp2 compiled each unit before sharding).
    # Checkpoints keep using the raw model, so their keys carry no `_orig_mod.` prefix.
    step_model = torch.compile(model) if tcfg.compile and not sharded else model
    scaler = scaler_for(tcfg.precision, env.device)
    monitor = Monitor(tcfg, monitor_key(cfg))
    pos = Position()
    held = state.CheckpointedObjects(
        model=parts.model,
        optimizers=parts.optimizers,
        scaler=scaler,
        ema=ema,
        monitor=monitor,
        callbacks=job.callbacks,
        position=PositionState(pos, _counting(job)),
        comm_hook=hook_state,
        device=env.device,
        sharded=sharded,
    )
    # ddp=fsdp2: sharded checkpoints, every rank writing its own shards (dcp.py).
    checkpointer = (DCPCheckpointer if sharded else Checkpointer)(
        run.output_dir, env, held, interval=tcfg.ckpt_interval, keep=tcfg.keep_ckpts,
        total_steps=job.total_steps, **({"async_save": tcfg.async_ckpt} if sharded else {}),
    )  # fmt: skip
    resumed = _resume(job, checkpointer)  # collective
    if resumed:
        finished = _finished_summary(run.output_dir, pos.step, job.total_steps, env)  # collective
        if finished is not None:
            return finished
    origin = provenance.record_run(
        run.output_dir, env, run.overrides, tcfg.untracked_content
    )  # collective
    tracker = make_tracker(cfg.logger, env, run, resumed_step=pos.step if resumed else None)
    tracker.add_config({"provenance": origin} if origin else {})
    with tracker, contextlib.ExitStack() as scope:
        job.console.show_config(redact.config(run.config))
        _log_plan(job)
        if tcfg.detect_anomaly:
            log.warning("autograd anomaly detection is on (trainer.detect_anomaly): slow")
            scope.enter_context(torch.autograd.detect_anomaly())
        # A job that fails with a background save under way leaves no partial folder.
        scope.callback(checkpointer.abandon)
        loop = _loop(job, held, step_model, checkpointer, tracker, scope)
        scope.callback(loop.stopper.restore)  # the signal handlers as they were before
        start_step = pos.step
        wall = fit(loop)
        return finish_run(loop, start_step, wall)


def _loop(
    job: Job,
    held: state.CheckpointedObjects,
    step_model: torch.nn.Module,
    checkpointer: Checkpointer,
    tracker: Tracker,
    scope: contextlib.ExitStack,
) -> Loop:
    """The loop's parts, around the model, the checkpoint members and the tracker."""
    cfg, env, run, parts = job.cfg, job.env, job.run, job.components
    tcfg, pos, ema = cfg.trainer, held.position.pos, held.ema
    autocast = autocast_for(tcfg.precision, env.device)
    evaluator = Evaluator(
        env=env,
        splits=job.evals,
        model=parts.model if ema is None else ema.module,
        loss_fn=parts.objective,
        metrics=parts.metrics,
        autocast=autocast,
        limit=tcfg.limit_eval_batches,
        interval=tcfg.eval_interval,
        total_steps=job.total_steps,
        monitor=held.monitor,
        checkpointer=checkpointer,
        tracker=tracker,
        console=job.console,
        pruning=Pruning(env),  # a no-op unless a pruning sweep started this job
    )
    stats = StepStats(
        env=env,
        tracker=tracker,
        console=job.console,
        log_interval=tcfg.log_interval,
        total_steps=job.total_steps,
        start_step=pos.step,
        unit=parts.source.unit,
        items_per_row=parts.source.items_per_row,
    )
    tools = StepTools(
        scaler=held.scaler,
        autocast=autocast,
        max_norm=tcfg.grad_clip,
        skip_non_finite=tcfg.nan_policy == NanPolicy.skip,
        raw_model=parts.model,
        optimizers=parts.optimizers.optimizers,
    )
    return Loop(
        env=env,
        tcfg=tcfg,
        job=job,
        pos=pos,
        raw_model=parts.model,
        step_model=step_model,
        tools=tools,
        ema=ema,
        checkpointer=checkpointer,
        evaluator=evaluator,
        stats=stats,
        tracker=tracker,
        health=NonFiniteCheck(env, tcfg.nan_policy),
        stopper=StopOnSignal(env, cfg.dist.timeout_s),
        profiler=scope.enter_context(step_profiler(tcfg, env, run.output_dir)),
        ctx=Context(
            env.rank, env.world_size, parts.model, run.output_dir, _sink=tracker.log_values
        ),
    )


def _counting(job: Job) -> Counting:
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


def _resume(job: Job, checkpointer: Checkpointer) -> bool:
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


def _finished_summary(
    output_dir: Path, step: int, total_steps: int, env: DistEnv
) -> dict[str, Any] | None:
    """Collective: the earlier summary when the checkpoint resumed from already ends the run,
    else None. Rank 0 reads it and every rank returns the same, so no rank trains alone on an
    output dir that another node cannot see."""
    path = output_dir / "summary.json"
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


def _log_plan(job: Job) -> None:
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


def _total_epochs(total_steps: int, grad_accum: int, micro_batches_per_epoch: int) -> int:
    """The epochs the run starts (the last maybe in part), for an epoch-stepped schedule."""
    return -(-total_steps * grad_accum // max(micro_batches_per_epoch, 1))


def _make_deterministic() -> None:
    """trainer.deterministic: the same result for the same inputs, at some cost in speed."""
    # cuBLAS reads it when its first handle is made, after this (the model is not built yet).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
