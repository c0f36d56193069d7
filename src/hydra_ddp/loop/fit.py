"""The training loop: `build_loop` gathers what it works with, `fit` runs the steps,
`finish_run` ends the run (last validation, last checkpoint, test, summary). Each periodic
concern is an object that decides its own cadence (`due(step)`) and owns its state, called
explicitly in order (the table: docs/extending.md). Only the loop moves the position.

A call marked `# collective` must be reached by every rank at the same step; putting one under
`if env.is_main:` hangs the job.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from hydra_ddp import memory
from hydra_ddp.batches import rows, to_device
from hydra_ddp.callbacks import Context
from hydra_ddp.checkpoint import Checkpointer, state
from hydra_ddp.config import NanPolicy, TrainerConfig
from hydra_ddp.distributed import DistEnv, all_gather_floats
from hydra_ddp.distributed.fsdp import state_bytes
from hydra_ddp.distributed.preemption import Preempted, StopOnSignal, signal_name, stop_message
from hydra_ddp.loop.evaluation import Evaluator, Pruning, prefixed
from hydra_ddp.loop.position import Position, batches
from hydra_ddp.loop.wrapping import EMA, Wrapped
from hydra_ddp.rank_job import RankJob
from hydra_ddp.rundir import jsonfile
from hydra_ddp.step import NonFiniteCheck, StepTools, autocast_for
from hydra_ddp.tracking import Tracker
from hydra_ddp.tracking.peak import PeakMeter, held_bytes
from hydra_ddp.tracking.stats import StepStats

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Loop:
    """What the loop works with (see the module docstring), built by `build_loop`."""

    env: DistEnv
    tcfg: TrainerConfig
    job: RankJob
    pos: Position
    raw_model: torch.nn.Module
    step_model: torch.nn.Module  # the DDP wrapper (compiled with trainer.compile)
    tools: StepTools  # precision, accumulation, clipping (step.py)
    ema: EMA | None
    checkpointer: Checkpointer
    evaluator: Evaluator
    stats: StepStats
    tracker: Tracker
    health: NonFiniteCheck
    stopper: StopOnSignal
    profiler: profile | None  # trainer.profile_steps
    ctx: Context
    meter: PeakMeter  # this rank's peak memory, over a window of fit's first steps


def build_loop(
    job: RankJob,
    wrapped: Wrapped,
    objects: state.CheckpointedObjects,
    checkpointer: Checkpointer,
    tracker: Tracker,
    scope: contextlib.ExitStack,
) -> Loop:
    """What the loop works with, around the wrapped model, the checkpointed objects and the tracker;
    what must be undone when the job ends goes on `scope`."""
    cfg, env, run, model = job.cfg, job.env, job.run, job.components.model
    tcfg, pos, ema = cfg.trainer, objects.position.pos, wrapped.ema
    autocast = autocast_for(tcfg.precision, env.device)
    evaluator = Evaluator(
        env=env, splits=job.evals, model=model if ema is None else ema.module,
        loss_fn=job.components.loss, metrics=job.components.metrics, autocast=autocast,
        limit=tcfg.limit_eval_batches, interval=tcfg.eval_interval,
        total_steps=job.total_steps, monitor=objects.monitor, checkpointer=checkpointer,
        tracker=tracker, console=job.console, pruning=Pruning(env),
    )  # fmt: skip
    # This rank's stats: its own file, the console (rank 0) and the tracker's sinks.
    stats = StepStats(
        env=env, tracker=tracker, console=job.console, log_interval=tcfg.log_interval,
        total_steps=job.total_steps, start_step=pos.step, unit=job.train_data.source.unit,
        items_per_row=job.train_data.source.items_per_row,
    )  # fmt: skip
    tools = StepTools(
        scaler=objects.scaler, autocast=autocast, max_norm=tcfg.grad_clip,
        skip_non_finite=tcfg.nan_policy == NanPolicy.skip, raw_model=model,
        optimizers=job.components.optimizers.optimizers,
    )  # fmt: skip
    profiler = None
    if tcfg.profile_steps > 0:
        profiler = scope.enter_context(step_profiler(tcfg, env, run.output_dir))
    loop = Loop(
        env=env, tcfg=tcfg, job=job, pos=pos, raw_model=model, step_model=wrapped.step_model,
        tools=tools, ema=ema, checkpointer=checkpointer, evaluator=evaluator, stats=stats,
        tracker=tracker, health=NonFiniteCheck(env, tcfg.nan_policy),
        stopper=StopOnSignal(env, cfg.dist.timeout_s),
        profiler=profiler,
        meter=PeakMeter(env.device, memory.window_steps(cfg, env.device)),
        ctx=Context(env.rank, env.world_size, model, run.output_dir, _sink=tracker.log_values),
    )  # fmt: skip
    scope.callback(loop.stopper.restore)  # the signal handlers as they were before
    return loop


def fit(loop: Loop) -> float:
    """The training loop, from `loop.pos` to trainer.max_steps (or the end of trainer.epochs,
    or an early stop); returns its wall time. `# collective`: every rank, same step."""
    tcfg, env, job, pos = loop.tcfg, loop.env, loop.job, loop.pos
    components, callbacks = job.components, job.callbacks
    data = batches(job.train_data, pos, tcfg)
    epochs_done = pos.epochs_done(job.micro_batches_per_epoch)
    callbacks("on_train_start", _context_at(loop.ctx, pos))
    t_start = time.perf_counter()
    loop.step_model.train()
    loop.stopper.start()
    loop.tools.before_step = callbacks.before_step(loop.ctx, lambda: (pos.step + 1, pos.epoch))
    loop.tools.keep_outputs = callbacks.has("on_step_end")  # ctx.outputs
    held = functools.partial(held_bytes, loop.raw_model, components.optimizers.optimizers.values())
    while pos.step < job.total_steps:
        signum = loop.stopper.agreed()  # collective
        if signum:
            _stop(loop, signum)  # collective: checkpoint, then raise Preempted
        t_step = time.perf_counter()
        micro_batches = []
        for _ in range(_micro_batches(job, pos)):
            # The epoch moves on only when the next epoch's first batch is drawn: at the end
            # of an epoch, batch_in_epoch (counted from 1) is its length.
            pos.epoch, pos.batch_in_epoch, batch = next(data)
            micro_batches.append(batch)
        data_wait = time.perf_counter() - t_step
        micro_batches = [to_device(b, env.device) for b in micro_batches]
        micro_rows = [rows(b) for b in micro_batches]
        with loop.meter.saving(loop.raw_model, micro_rows[0], len(micro_batches)):
            losses = components.step_fn(
                loop.tools, loop.step_model, micro_batches, components.loss,
                components.optimizers.optimizers,
            )  # fmt: skip
        grad_norm = loop.tools.update()
        outputs, loop.tools.outputs = loop.tools.outputs, []
        loop.health.observe(pos.step + 1, losses["loss"], grad_norm)
        components.optimizers.step_schedules()
        if loop.ema is not None:
            loop.ema.update(loop.raw_model)
        if loop.profiler is not None:
            loop.profiler.step()
        loop.meter.step(held)
        pos.step += 1
        batch_rows = sum(micro_rows)
        pos.samples_seen += batch_rows
        loop.stats.add_step(losses, batch_rows, time.perf_counter() - t_step, data_wait)
        _periodic(loop, grad_norm)  # collective
        at_step = _context_at(
            loop.ctx, pos, loss=losses["loss"], batch=micro_batches, outputs=outputs, losses=losses
        )
        callbacks("on_step_end", at_step)
        _context_at(loop.ctx, pos, batch=None, outputs=None, losses=None)  # kept for the call only
        del outputs
        for epoch in range(epochs_done, pos.epochs_done(job.micro_batches_per_epoch)):
            callbacks("on_epoch_end", _context_at(loop.ctx, pos, epoch=epoch))
            components.optimizers.end_epoch()  # scheduler.interval=epoch
            epochs_done = epoch + 1
        if loop.evaluator.due(pos.step):
            metrics = loop.evaluator.validate(pos)  # collective (+ best.pt)
            components.optimizers.after_validation(metrics)  # scheduler.monitor
            callbacks("on_eval_end", _context_at(loop.ctx, pos, metrics=prefixed("val", metrics)))
            if loop.evaluator.monitor.stopped_early:  # or a pruning sweep's pruner
                break
        loop.checkpointer.maybe_save()  # collective
    if loop.stats.steps:  # an early stop between two log intervals: its last steps' stats
        loop.health.check()  # collective
        _log_stats(loop, grad_norm)  # collective
    loop.stats.close()
    return time.perf_counter() - t_start


def _periodic(loop: Loop, grad_norm: Any) -> None:
    """Collective: after a step, the health check before anything is logged, judged or saved;
    then the step stats when due."""
    step = loop.pos.step
    if loop.stats.due(step) or loop.evaluator.due(step) or loop.checkpointer.due(step):
        loop.health.check()  # collective: nothing non-finite is logged, judged or saved
    if loop.stats.due(step):
        _log_stats(loop, grad_norm)  # collective


def _log_stats(loop: Loop, grad_norm: Any) -> None:
    job, pos = loop.job, loop.pos
    loop.stats.log(
        pos.step,
        grad_norm,
        job.components.optimizers.learning_rates(),
        samples_seen=pos.samples_seen,
        data_rows=job.train_data.rows_held,
        data_bytes=job.train_data.bytes_held,
        epoch=pos.epoch,
    )


def finish_run(loop: Loop, start_step: int, wall: float) -> dict[str, Any]:
    """Collective: last validation, last checkpoint, test, summary; the same on every rank."""
    job, env, run, pos = loop.job, loop.env, loop.job.run, loop.pos
    if loop.stopper.received:  # came after the last step: the run ends normally
        log.warning(
            "got %s after the last step: finishing the final evaluation and checkpoint first",
            signal_name(loop.stopper.received),
        )
    loop.health.check()  # collective
    validated = not loop.evaluator.monitor.stopped_early  # else the loop validated this very step
    val = loop.evaluator.final_validation(pos)  # collective
    if validated:
        job.callbacks("on_eval_end", _context_at(loop.ctx, pos, metrics=prefixed("val", val)))
    # The last checkpoint after the last on_eval_end: it holds the callbacks' final state, so
    # a finished run extended with a larger trainer.max_steps continues their counters.
    val, test = loop.evaluator.finish(pos)  # collective
    summary = _summary(loop, start_step, wall, val, test)  # collective
    summary.update(loop.evaluator.monitor.summary())
    # The memory plan, checked by this run.
    planned = memory.of_this_run(
        job.cfg, env, loop.raw_model, job.components.optimizers.optimizers.values(), loop.meter
    )
    summary.update(memory.memory_summary(planned, env, loop.meter))  # collective
    loop.tracker.summary({k: v for k, v in summary.items() if isinstance(v, (int, float))})
    if env.is_main:
        jsonfile.write(run.output_dir / "summary.json", json_safe(summary))
        # An earlier attempt of this job that failed (a sweep job re-run here) is over.
        (run.output_dir / "failure.json").unlink(missing_ok=True)
    job.console.show_summary(summary, run.output_dir)
    metrics = {**prefixed("val", val), **prefixed("test", test)}
    job.callbacks("on_train_end", _context_at(loop.ctx, pos, metrics=metrics))
    # Every rank is past its last collective before rank 0 waits on W&B's uploads.
    loop.tracker.close_all()  # collective
    return summary


def _stop(loop: Loop, signum: int) -> None:
    """Collective: a stop signal reached some rank. Checkpoint, close the W&B run as preempted,
    let an earlier handler of the signal run (submitit's requeue), and leave."""
    loop.stats.close()
    loop.checkpointer.save()  # collective
    loop.stopper.saved()
    loop.tracker.close(preempted=signum)
    message = stop_message(signum, loop.pos.step, loop.job.total_steps, loop.job.run)
    stopped = Preempted(signum, message)
    # Said before the earlier handlers run: submitit's requeues and exits from inside chain().
    (log.warning if loop.env.is_main else log.info)("%s", stopped)
    stopped.logged = True
    loop.stopper.chain()
    raise stopped


def _micro_batches(job: RankJob, pos: Position) -> int:
    """Micro-batches of the next step: trainer.grad_accum, or what is left of the epochs."""
    accum = job.cfg.trainer.grad_accum
    if job.total_micro is None:
        return accum
    done = pos.epoch * job.micro_batches_per_epoch + pos.batch_in_epoch
    return min(accum, job.total_micro - done)


def _context_at(ctx: Context, pos: Position, **fields_: Any) -> Context:
    """The callbacks' context, moved to `pos` (and `fields_`: loss, metrics, epoch)."""
    ctx.step, ctx.epoch = pos.step, pos.epoch
    for name, value in fields_.items():
        setattr(ctx, name, value)
    return ctx


def _summary(loop: Loop, start_step: int, wall: float, val: dict, test: dict) -> dict[str, Any]:
    """Collective: the job's summary.json, the same on every rank."""
    job, env, pos, stats = loop.job, loop.env, loop.pos, loop.stats
    unit = job.train_data.source.unit
    # Parameters + gradients + optimizer state each rank holds (ddp=fsdp2: its shards).
    state = state_bytes(job.components.model, job.components.optimizers.optimizers.values())
    data = job.train_data
    ranks = all_gather_floats(
        [stats.total_samples, stats.last_loss, data.rows_held, data.bytes_held, state], env
    )
    # A re-run that only evaluated (killed after its last checkpoint, before its summary) has
    # no training loss or rate of its own: null, not a NaN that reads as a diverged run.
    trained = pos.step > start_step
    summary: dict[str, Any] = {
        "world_size": env.world_size,
        "steps": pos.step,
        "steps_this_run": pos.step - start_step,
        "epochs": pos.epoch + (pos.batch_in_epoch / max(job.micro_batches_per_epoch, 1)),
        "train_loss": sum(r[1] for r in ranks) / env.world_size if trained else None,
        f"{unit}_per_s": sum(r[0] for r in ranks) / max(wall, 1e-9) if trained else None,
        "wall_time_s": wall,
        "rows_held_per_rank": [int(r[2]) for r in ranks],
        "state_bytes_per_rank": [int(r[4]) for r in ranks],
        "bytes_held_per_rank": [int(r[3]) for r in ranks],
        "sampler": job.train_data.policy.name,
        "objective": val[loop.evaluator.monitor.metric],  # trainer.monitor
    }
    # val_loss, val_acc, test_ppl, ...: the loss and every configured metric of both splits.
    for split, metrics in (("val", val), ("test", test)):
        summary.update({f"{split}_{k}": v for k, v in metrics.items()})
    return summary


def json_safe(summary: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN or inf: such metrics are written as null, with a warning."""
    bad = [k for k, v in summary.items() if jsonfile.finite_or_none(v) is None and v is not None]
    if bad:
        log.warning("not finite, written as null in summary.json: %s", ", ".join(bad))
    return {k: jsonfile.finite_or_none(v) for k, v in summary.items()}


def step_profiler(tcfg: TrainerConfig, env: DistEnv, output_dir: Path) -> profile:
    """trainer.profile_steps: torch.profiler over a window of training steps, on every rank,
    each writing `profile/rank<r>.pt.trace.json` (a Chrome trace) and logging its slowest ops,
    so a slow rank can be compared with the others at a glance."""
    cuda = env.device.type == "cuda"
    folder = Path(output_dir) / "profile"

    def ready(prof: profile) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{env.rank}.pt.trace.json"
        prof.export_chrome_trace(str(path))
        log.info(
            "profile of steps %d-%d on rank %d (trace: %s; open in ui.perfetto.dev):\n%s",
            tcfg.profile_start + 1,
            tcfg.profile_start + tcfg.profile_steps,
            env.rank,
            path,
            prof.key_averages().table(
                sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=15
            ),
        )

    return profile(
        activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])],
        # One warm-up step inside the skipped ones: the profiler's own start-up stays out of
        # the recorded window.
        schedule=schedule(
            skip_first=max(tcfg.profile_start - 1, 0),
            wait=0,
            warmup=1 if tcfg.profile_start > 0 else 0,
            active=tcfg.profile_steps,
            repeat=1,
        ),
        on_trace_ready=ready,
    )
