"""One rank's training job: build, resume, loop, evaluate, checkpoint, summarise.

`train(cfg, env, run)` is the whole job of one rank, the same on every rank (torchrun's, the
self-launched workers', a submitit task's, or the single process of `python -m
hydra_ddp.train`). `fit` is the loop. It calls each periodic concern explicitly, in order;
each one decides its own cadence (`due(step)`) and owns its state:

    stopper      preemption.StopOnSignal   a stop signal: checkpoint, then exit
    default_step step.py                   forward, loss, backward, clip, optimizer step
    health       step.NonFiniteCheck       trainer.nan_policy, without a sync per step
    ema          ema.EMA                   trainer.ema_decay
    profiler     profiling.py              trainer.profile_steps
    stats        stats.StepStats           per-rank stats, console, W&B (tracking.Tracker)
    callbacks    callbacks.Callbacks       the user's hooks
    evaluator    evaluation.Evaluator      validation, monitor, best checkpoint, early stop
    checkpointer checkpoint.Checkpointer   checkpoints every trainer.ckpt_interval steps

A call marked `# collective` must be reached by every rank at the same step (it talks to the
other ranks); putting one under `if env.is_main:` hangs the job.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from hydra_ddp import checkpoint, tracking
from hydra_ddp.callbacks import Callbacks, Context
from hydra_ddp.checkpoint import Checkpointer
from hydra_ddp.checkpoint.dcp import DCPCheckpointer, load_sharded
from hydra_ddp.components import build
from hydra_ddp.config import NanPolicy, TrainConfig, TrainerConfig, Wrapper
from hydra_ddp.data import DataSource, EvalData, TrainData, check_source, epoch_rows
from hydra_ddp.dist import (
    DistEnv,
    all_gather_floats,
    all_gather_objects,
    all_reduce_sum,
    jsonfile,
    process_group,
    provenance,
    use_device,
)
from hydra_ddp.dist.ddp import wrap_model
from hydra_ddp.dist.fsdp import state_bytes
from hydra_ddp.dist.preemption import (
    Preempted,
    StopOnSignal,
    exit_with_parent,
    signal_name,
    stop_message,
)
from hydra_ddp.errors import translated
from hydra_ddp.loop.ema import EMA
from hydra_ddp.loop.evaluation import Evaluator
from hydra_ddp.loop.monitor import Monitor, monitor_key
from hydra_ddp.loop.objective import Objective, rows, to_device
from hydra_ddp.loop.profiling import step_profiler
from hydra_ddp.optim import Optimizers
from hydra_ddp.step import NonFiniteCheck, StepTools, autocast_for, default_step, scaler_for
from hydra_ddp.tracking import RunInfo, make_tracker, redact
from hydra_ddp.tracking.console import Console
from hydra_ddp.tracking.stats import StepStats

log = logging.getLogger(__name__)


@dataclass
class Position:
    """Where the loop is: the one copy, saved in checkpoints so a resumed run continues
    mid-epoch (the sampler is told epoch and batch at each epoch start)."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of this epoch already trained on
    samples_seen: int = 0  # by this rank


@dataclass
class Components:
    """The user's components, built from their config groups before any process group."""

    source: DataSource
    model: torch.nn.Module
    objective: Objective  # the loss, called as its parameters ask (see objective.py)
    metrics: dict[str, Any]
    optimizers: Optimizers  # one (`default`) or several named, with their schedules
    step: Callable  # step.default_step, or the user's step._target_ / model.training_step


def build_components(cfg: TrainConfig, source: DataSource, device: torch.device,
                     total_steps: int, total_epochs: int | None = None) -> Components:  # fmt: skip
    """Model, loss, metrics, optimizers and schedules, and the step, each from its config.
    `total_epochs`: what an epoch-stepped schedule (scheduler.interval=epoch) runs for."""
    if cfg.ddp.meta_init:  # ddp.meta_init: shapes only; fsdp.wrap allocates each rank's shards
        with torch.device("meta"):
            model = build(cfg.model, "model", **source.spec)
    else:
        model = build(cfg.model, "model", **source.spec).to(device)
    if cfg.step is not None:
        step = build(cfg.step, "step", _as_function=True)
    else:
        step = getattr(model, "training_step", None) or default_step
    return Components(
        source=source,
        model=model,
        objective=Objective(build(cfg.loss, "loss", _as_function=True)),
        metrics={name: build(m, f"metrics.{name}") for name, m in cfg.metrics.items()},
        optimizers=Optimizers.build(
            cfg.optim, cfg.scheduler, model, total_steps, total_epochs, ["loss", *cfg.metrics]
        ),
        step=step,
    )


@dataclass
class Job:
    """Everything one rank needs, built before the process group starts: bad input fails
    here, once per rank, before any rank waits for another."""

    cfg: TrainConfig
    env: DistEnv
    run: RunInfo
    console: Console
    parts: Components
    train_data: TrainData
    evals: dict[str, EvalData]
    steps_per_epoch: int  # micro-batches per epoch and rank
    total_steps: int  # optimizer steps
    total_micro: int | None  # micro-batches of trainer.epochs (None: trainer.max_steps)
    callbacks: Callbacks
    resume_from: Path | None
    # ddp.meta_init: the trainer.init_from checkpoint, loaded into the shards after the wrap.
    init_sharded: Path | None = None


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
    steps_per_epoch = _epoch_length(train_data.steps_per_epoch, tcfg)
    # trainer.epochs counts passes over the data: its micro-batches, whatever grad_accum is;
    # the last step takes what is left (a smaller step) when they do not divide.
    total_micro = tcfg.epochs * steps_per_epoch if tcfg.max_steps <= 0 else None
    total_steps = tcfg.max_steps if total_micro is None else -(-total_micro // tcfg.grad_accum)
    total_epochs = _total_epochs(total_steps, tcfg.grad_accum, steps_per_epoch)
    parts = build_components(cfg, source, env.device, total_steps, total_epochs)
    callbacks = Callbacks(cfg.callbacks, data=source)
    checkpoint.check_folder(run.output_dir)
    resume_from = checkpoint.resolve_resume(tcfg.resume, run.output_dir)
    if tcfg.resume == "never" and env.is_main:
        checkpoint.set_aside(run.output_dir)
        tracking.set_aside(run.output_dir)  # the stats files and summary.json
    init_sharded = None
    if tcfg.init_from and resume_from is None and cfg.ddp.meta_init:  # no weights to load into yet
        init_sharded = checkpoint.file_or_newest(
            tcfg.init_from, "trainer.init_from", "no trainer.init_from"
        )
    elif tcfg.init_from and resume_from is None:
        checkpoint.init_weights(parts.model, tcfg.init_from, tcfg.init_strict)
    elif tcfg.init_from:
        log.info("trainer.init_from=%s not used: resuming %s", tcfg.init_from, resume_from)
    return Job(
        cfg, env, run, console, parts, train_data, evals, steps_per_epoch, total_steps,
        total_micro, callbacks, resume_from, init_sharded,
    )  # fmt: skip


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


@dataclass
class Loop:
    """The loop's parts (see the module docstring), built by `_run`."""

    env: DistEnv
    tcfg: TrainerConfig
    job: Job
    raw_model: torch.nn.Module
    step_model: torch.nn.Module  # the DDP wrapper (compiled with trainer.compile)
    tools: StepTools  # precision, accumulation, clipping (step.py)
    ema: EMA | None
    checkpointer: Checkpointer
    evaluator: Evaluator
    stats: StepStats
    health: NonFiniteCheck
    stopper: StopOnSignal
    profiler: Any
    ctx: Context


def _run(job: Job) -> dict[str, Any]:
    """Everything after the process group is up. Its frame holds the DDP wrapper, which so dies
    when it returns, before the process group (see dist.process_group)."""
    cfg, env, run, parts = job.cfg, job.env, job.run, job.parts
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
        load_sharded(parts.model, job.init_sharded, env)  # collective
    if sharded:  # fully_shard replaced the parameters: the optimizers must hold the new ones
        parts.optimizers = Optimizers.build(
            cfg.optim, cfg.scheduler, model, job.total_steps,
            _total_epochs(job.total_steps, tcfg.grad_accum, job.steps_per_epoch),
            ["loss", *cfg.metrics],
        )  # fmt: skip
    # Compiled after the DDP wrap, as torch's DDP docs recommend: dynamo's DDPOptimizer then
    # splits the graph at DDP's bucket boundaries, so each bucket's all-reduce still starts
    # while the backward of the earlier layers runs (fsdp2 compiled each unit before sharding).
    # Checkpoints keep using the raw model, so their keys carry no `_orig_mod.` prefix.
    step_model = torch.compile(model) if tcfg.compile and not sharded else model
    scaler = scaler_for(tcfg.precision, env.device)
    monitor = Monitor(tcfg, monitor_key(cfg))
    stateful = dict(
        model=parts.model, optimizer=parts.optimizers, scaler=scaler, monitor=monitor,
        callbacks=job.callbacks, **({"ema": ema} if ema else {}),
    )  # fmt: skip
    # ddp=fsdp2: sharded checkpoints, every rank writing its own shards (dcp.py).
    checkpointer = (DCPCheckpointer if sharded else Checkpointer)(
        run.output_dir, env, tcfg.ckpt_interval, tcfg.keep_ckpts, job.total_steps, stateful,
        per_rank={"comm_hook": hook_state} if hook_state else None,
        meta={"batch_size": tcfg.batch_size},
        **({"async_save": tcfg.async_ckpt} if sharded else {}),
    )  # fmt: skip
    pos, resumed = _resume(job, checkpointer)  # collective
    if resumed:
        finished = _finished_summary(run.output_dir, pos.step, job.total_steps, env)  # collective
        if finished is not None:
            return finished
    origin = provenance.record(
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
        autocast = autocast_for(tcfg.precision, env.device)
        tools = StepTools(scaler, autocast, tcfg.grad_clip,
                          tcfg.nan_policy == NanPolicy.skip, raw_model=parts.model,
                          optimizers=parts.optimizers.optimizers)  # fmt: skip
        loop = Loop(
            env, tcfg, job, parts.model, step_model, tools, ema, checkpointer,
            Evaluator(
                env, job.evals, parts.model if ema is None else ema.module, parts.objective,
                parts.metrics, autocast, tcfg.limit_eval_batches, tcfg.eval_interval,
                job.total_steps, monitor, checkpointer, tracker, job.console,
            ),
            StepStats(
                env, tracker, job.console, tcfg.log_interval, job.total_steps, pos.step,
                parts.source.unit, parts.source.items_per_row,
            ),
            NonFiniteCheck(env, tcfg.nan_policy),
            StopOnSignal(env, cfg.dist.timeout_s),
            scope.enter_context(step_profiler(tcfg, env, run.output_dir)),
            Context(env.rank, env.world_size, parts.model, run.output_dir,
                    _sink=tracker.log_values),
        )  # fmt: skip
        scope.callback(loop.stopper.restore)  # the signal handlers as they were before
        start_step = pos.step
        wall = fit(loop, pos)
        return _finish(loop, pos, start_step, wall)


def fit(loop: Loop, pos: Position) -> float:
    """The training loop, from `pos` to trainer.max_steps (or the end of trainer.epochs, or an
    early stop); returns its wall time. `# collective`: every rank, same step."""
    tcfg, env, job = loop.tcfg, loop.env, loop.job
    parts, callbacks = job.parts, job.callbacks
    batches = _batches(job.train_data, pos, tcfg)
    epochs_done = _epochs_done(pos, job.steps_per_epoch)
    callbacks("on_train_start", _at(loop.ctx, pos))
    t_start = time.perf_counter()
    loop.step_model.train()
    loop.stopper.start()
    loop.tools.before_step = callbacks.before_step(loop.ctx, lambda: (pos.step + 1, pos.epoch))
    loop.tools.keep_outputs = callbacks.has("on_step_end")  # ctx.outputs
    while pos.step < job.total_steps:
        signum = loop.stopper.agreed()  # collective
        if signum:
            _stop(loop, pos, signum)  # collective: checkpoint, then raise Preempted
        t_step = time.perf_counter()
        micro_batches = [next(batches) for _ in range(_micro_batches(job, pos))]
        data_wait = time.perf_counter() - t_step
        micro_batches = [to_device(b, env.device) for b in micro_batches]
        losses = parts.step(
            loop.tools, loop.step_model, micro_batches, parts.objective,
            parts.optimizers.optimizers,
        )  # fmt: skip
        grad_norm = loop.tools.update()
        outputs, loop.tools.outputs = loop.tools.outputs, []
        loop.health.observe(pos.step + 1, losses["loss"], grad_norm)
        parts.optimizers.step_schedules()
        if loop.ema is not None:
            loop.ema.update(loop.raw_model)
        loop.profiler.step()
        pos.step += 1
        batch_rows = sum(rows(b) for b in micro_batches)
        pos.samples_seen += batch_rows
        loop.stats.add_step(losses, batch_rows, time.perf_counter() - t_step, data_wait)

        step = pos.step
        if loop.stats.due(step) or loop.evaluator.due(step) or loop.checkpointer.due(step):
            loop.health.check()  # collective: nothing non-finite is logged, judged or saved
        if loop.stats.due(step):
            lrs = parts.optimizers.learning_rates()
            loop.stats.log(step, grad_norm, lrs, **_data_stats(job, pos))  # collective
        callbacks("on_step_end", _at(loop.ctx, pos, loss=losses["loss"], batch=micro_batches,
                                     outputs=outputs, losses=losses))  # fmt: skip
        _at(loop.ctx, pos, batch=None, outputs=None, losses=None)  # kept for the call only
        del outputs
        for epoch in range(epochs_done, _epochs_done(pos, job.steps_per_epoch)):
            callbacks("on_epoch_end", _at(loop.ctx, pos, epoch=epoch))
            parts.optimizers.end_epoch()  # scheduler.interval=epoch
            epochs_done = epoch + 1
        if loop.evaluator.due(step):
            metrics = loop.evaluator.validate(pos)  # collective (+ best.pt)
            parts.optimizers.after_validation(metrics)  # scheduler.monitor
            callbacks("on_eval_end", _at(loop.ctx, pos, metrics=_prefixed("val", metrics)))
            if loop.evaluator.should_stop:
                break
        loop.checkpointer.maybe_save(asdict(pos))  # collective
    if loop.stats.steps:  # an early stop between two log intervals: its last steps' stats
        loop.health.check()  # collective
        lrs = parts.optimizers.learning_rates()
        loop.stats.log(pos.step, grad_norm, lrs, **_data_stats(job, pos))  # collective
    loop.stats.close()
    return time.perf_counter() - t_start


def _finish(loop: Loop, pos: Position, start_step: int, wall: float) -> dict[str, Any]:
    """Collective: last validation, last checkpoint, test, summary; the same on every rank."""
    job, env, run = loop.job, loop.env, loop.job.run
    if loop.stopper.received:  # came after the last step: the run ends normally
        log.warning(
            "got %s after the last step: finishing the final evaluation and checkpoint first",
            signal_name(loop.stopper.received),
        )
    loop.health.check()  # collective
    validated = not loop.evaluator.should_stop  # else the loop validated this very step
    val = loop.evaluator.final_validation(pos)  # collective
    if validated:
        job.callbacks("on_eval_end", _at(loop.ctx, pos, metrics=_prefixed("val", val)))
    # The last checkpoint after the last on_eval_end: it holds the callbacks' final state, so
    # a finished run extended with a larger trainer.max_steps continues their counters.
    val, test = loop.evaluator.finish(pos)  # collective
    summary = _summary(job, pos, start_step, wall, loop.stats, val, test)  # collective
    summary.update(loop.evaluator.monitor.summary())
    tracker = loop.evaluator.tracker
    tracker.summary({k: v for k, v in summary.items() if isinstance(v, (int, float))})
    if env.is_main:
        jsonfile.write(run.output_dir / "summary.json", _json_safe(summary))
        # An earlier attempt of this job that failed (a sweep job re-run here) is over.
        (run.output_dir / "failure.json").unlink(missing_ok=True)
    job.console.show_summary(summary, run.output_dir)
    metrics = {**_prefixed("val", val), **_prefixed("test", test)}
    job.callbacks("on_train_end", _at(loop.ctx, pos, metrics=metrics))
    # Every rank is past its last collective before rank 0 waits on W&B's uploads.
    tracker.close_all()  # collective
    return summary


def _stop(loop: Loop, pos: Position, signum: int) -> None:
    """Collective: a stop signal reached some rank. Checkpoint, close the W&B run as preempted,
    let an earlier handler of the signal run (submitit's requeue), and leave."""
    loop.stats.close()
    loop.checkpointer.save(asdict(pos))  # collective
    loop.evaluator.tracker.close(preempted=signum)
    stopped = Preempted(signum, stop_message(signum, pos.step, loop.job.total_steps, loop.job.run))
    # Said before the earlier handlers run: submitit's requeues and exits from inside chain().
    (log.warning if loop.env.is_main else log.info)("%s", stopped)
    stopped.logged = True
    loop.stopper.chain()
    raise stopped


def _resume(job: Job, checkpointer: Checkpointer) -> tuple[Position, bool]:
    """Collective: the position to start from, restored from the checkpoint rank 0 picked (a
    lagging or node-local file system could show each rank another newest one)."""
    env, tcfg = job.env, job.cfg.trainer
    # Saved in every checkpoint: a resume that changes them can tell what that does to the epoch.
    checkpointer.meta["sampler"] = epoch_rows.settings(job.cfg.sampler, job.cfg.sampler_seed)
    path = all_gather_objects(job.resume_from if env.is_main else None, env)[0]
    if path is None:
        # Different dropout masks per rank; the weights are already equal (same seed, and
        # DDP broadcasts rank 0's at construction).
        torch.manual_seed(tcfg.seed + env.rank)
        return Position(), False
    saved = checkpointer.restore(path, [f.name for f in fields(Position)])
    world, batch_size = saved.pop("saved_world_size"), saved.pop("saved_batch_size")
    sampler = saved.pop("saved_sampler")
    pos = Position(**saved)
    _continue_epoch(pos, job, path, epoch_rows.Setup(sampler, world, batch_size or tcfg.batch_size))
    log.info(
        "resumed from %s at step %d (epoch %d, batch %d)",
        path,
        pos.step,
        pos.epoch,
        pos.batch_in_epoch,
    )
    return pos, True


def _continue_epoch(pos: Position, job: Job, path: Path, saved: epoch_rows.Setup) -> None:
    """Continue the epoch from its first unseen row when the checkpoint counted batches of
    another size or over another number of ranks. Rows of an epoch are consumed as a prefix of
    its order (strided: batch k of every rank covers positions [k·B·W, (k+1)·B·W)), so the
    new position is exact when the rows done divide into new batches; otherwise the rest of
    the last partial batch is trained again, and the log says how many rows. Other sampler
    settings: the log says how many rows of the epoch are read twice or skipped (epoch_rows)."""
    env, tcfg = job.env, job.cfg.trainer
    world, batch_size, done = saved.world_size, saved.batch_size, pos.batch_in_epoch
    now = epoch_rows.settings(job.cfg.sampler, job.cfg.sampler_seed)
    # A checkpoint from before the settings were recorded: taken to have this job's.
    saved.settings = saved.settings or now
    reordered = epoch_rows.changed(saved.settings, now, world, env.world_size)
    if (world, batch_size) != (env.world_size, tcfg.batch_size):
        rows_done = pos.batch_in_epoch * batch_size * world
        per_batch = tcfg.batch_size * env.world_size
        pos.batch_in_epoch = rows_done // per_batch
        again = rows_done - pos.batch_in_epoch * per_batch
        if not reordered:
            log.warning(
                "%s counted batches of %d rows on %d rank(s), this job %d on %d: epoch %d "
                "continues at its row %d (batch %d here)%s",
                path, batch_size, world, tcfg.batch_size, env.world_size, pos.epoch, rows_done,
                pos.batch_in_epoch,
                f"; {again} rows of it are trained again (not a whole batch)" if again
                else ", exactly",
            )  # fmt: skip
    if reordered and env.is_main and not tcfg.overfit_batches:
        here = epoch_rows.Setup(now, env.world_size, tcfg.batch_size)
        epoch_rows.say_reordered(
            path, saved, here, job.train_data.source, pos.epoch, done, pos.batch_in_epoch,
            tcfg.limit_train_batches,
        )  # fmt: skip
    if pos.batch_in_epoch >= job.steps_per_epoch:  # ended this epoch
        pos.epoch, pos.batch_in_epoch = pos.epoch + 1, 0


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


def _micro_batches(job: Job, pos: Position) -> int:
    """Micro-batches of the next step: trainer.grad_accum, or what is left of the epochs."""
    accum = job.cfg.trainer.grad_accum
    if job.total_micro is None:
        return accum
    return min(accum, job.total_micro - (pos.epoch * job.steps_per_epoch + pos.batch_in_epoch))


def _log_plan(job: Job) -> None:
    data, env, tcfg = job.train_data, job.env, job.cfg.trainer
    log.info(
        "%d rank(s) | %d train rows held by rank %d (%.1f MiB) | %g steps/epoch | %d steps",
        env.world_size,
        data.rows_held,
        env.rank,
        data.bytes_held / 2**20,
        job.steps_per_epoch / tcfg.grad_accum,
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


def _at(ctx: Context, pos: Position, **fields_: Any) -> Context:
    """The callbacks' context, moved to `pos` (and `fields_`: loss, metrics, epoch)."""
    ctx.step, ctx.epoch = pos.step, pos.epoch
    for name, value in fields_.items():
        setattr(ctx, name, value)
    return ctx


def _data_stats(job: Job, pos: Position) -> dict[str, int]:
    return {
        "samples_seen": pos.samples_seen,
        "data_rows": job.train_data.rows_held,
        "data_bytes": job.train_data.bytes_held,
        "epoch": pos.epoch,
    }


def _epoch_length(batches: int, tcfg: TrainerConfig) -> int:
    """Batches per epoch and rank, after trainer.overfit_batches / limit_train_batches."""
    if tcfg.overfit_batches:
        return min(tcfg.overfit_batches, batches)
    return min(tcfg.limit_train_batches, batches) if tcfg.limit_train_batches else batches


def _total_epochs(total_steps: int, grad_accum: int, steps_per_epoch: int) -> int:
    """The epochs the run starts (the last maybe in part), for an epoch-stepped schedule."""
    return -(-total_steps * grad_accum // max(steps_per_epoch, 1))


def _epochs_done(pos: Position, length: int) -> int:
    """Epochs completed at `pos`: the batch iterator moves to the next epoch only when the
    next batch is drawn, so a position at the end of epoch e has batch_in_epoch == length."""
    return pos.epoch + (1 if pos.batch_in_epoch >= length else 0)


def _batches(data: TrainData, pos: Position, tcfg: TrainerConfig) -> Iterator[Any]:
    """Training batches from `pos` on, forever, moving `pos` to the next epoch as each ends
    (the sampler reshuffles for it). trainer.overfit_batches: the first N batches of epoch 0,
    every epoch; trainer.limit_train_batches: each epoch ends after N batches."""
    length = _epoch_length(data.steps_per_epoch, tcfg)
    fixed = list(itertools.islice(data.epoch(0), length)) if tcfg.overfit_batches else None
    while True:
        epoch = fixed[pos.batch_in_epoch :] if fixed else data.epoch(pos.epoch, pos.batch_in_epoch)
        for batch in epoch:
            if pos.batch_in_epoch >= length:
                break
            pos.batch_in_epoch += 1
            yield batch
        pos.epoch, pos.batch_in_epoch = pos.epoch + 1, 0


def _summary(
    job: Job,
    pos: Position,
    start_step: int,
    wall: float,
    stats: StepStats,
    val: dict[str, float],
    test: dict[str, float],
) -> dict[str, Any]:
    """Collective: the job's summary.json, the same on every rank."""
    cfg, env, unit = job.cfg, job.env, job.parts.source.unit
    samples = all_reduce_sum([float(stats.total_samples)], env)[0]
    held = all_gather_floats([job.train_data.rows_held, job.train_data.bytes_held], env)
    summary: dict[str, Any] = {
        "world_size": env.world_size,
        "steps": pos.step,
        "steps_this_run": pos.step - start_step,
        "epochs": pos.epoch + (pos.batch_in_epoch / max(job.steps_per_epoch, 1)),
        "train_loss": all_reduce_sum([stats.last_loss], env)[0] / env.world_size,
        f"{unit}_per_s": samples / max(wall, 1e-9),
        "wall_time_s": wall,
        "rows_held_per_rank": [int(h[0]) for h in held],
        # Parameters + gradients + optimizer state each rank holds (ddp=fsdp2: its shards).
        "state_bytes_per_rank": [
            int(b[0])
            for b in all_gather_floats(
                [state_bytes(job.parts.model, job.parts.optimizers.optimizers.values())], env
            )
        ],  # fmt: skip
        "bytes_held_per_rank": [int(h[1]) for h in held],
        "sampler": job.train_data.policy.name,
        "objective": val[monitor_key(cfg)],  # trainer.monitor
    }
    # val_loss, val_acc, test_ppl, ...: the loss and every configured metric of both splits.
    for split, metrics in (("val", val), ("test", test)):
        summary.update({f"{split}_{k}": v for k, v in metrics.items()})
    return summary


def _json_safe(summary: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN or inf: such metrics are written as null, with a warning."""
    bad = [k for k, v in summary.items() if jsonfile.finite_or_none(v) is None and v is not None]
    if bad:
        log.warning("not finite, written as null in summary.json: %s", ", ".join(bad))
    return {k: jsonfile.finite_or_none(v) for k, v in summary.items()}


def _prefixed(split: str, metrics: dict[str, float]) -> dict[str, float]:
    return {f"{split}/{k}": v for k, v in metrics.items()}


def _make_deterministic() -> None:
    """trainer.deterministic: the same result for the same inputs, at some cost in speed."""
    # cuBLAS reads it when its first handle is made, after this (the model is not built yet).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
