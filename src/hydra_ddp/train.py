"""The Hydra entry point, the training loop and the training step.

    torchrun --standalone --nproc_per_node=2 -m hydra_ddp.train            # torchrun starts ranks
    python -m hydra_ddp.train dist.nproc_per_node=2                        # the job starts them
    python -m hydra_ddp.train -m dist.nproc_per_node=2 model=mlp,cnn       # a sweep of DDP jobs

`train_step` is one optimizer step: forward, loss, backward, clip, step. `train` is one rank's
whole job around it, top to bottom: build the components, start the process group, loop, log,
evaluate, checkpoint. `hydra_entry` composes and validates the config, then either trains in
this process (one rank of whatever launcher started it, or a single process) or starts its own
worker group with torch's elastic agent (see launch.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import json
import logging
import math
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterator

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from hydra_ddp import checkpoint, launch, sweeps
from hydra_ddp.components import build
from hydra_ddp.config import NanPolicy, Precision, TrainConfig, register_configs
from hydra_ddp.console import Console
from hydra_ddp.data import DataSource, EvalData, TrainData, check_sampling
from hydra_ddp.ddp import explain, wrap_model
from hydra_ddp.dist import (
    DistEnv,
    all_gather_floats,
    all_gather_objects,
    all_reduce_sum,
    barrier,
    destroy_process_group,
    env_from_environ,
    export_submitit_env,
    init_process_group,
    launcher_rank,
    lost_peer,
    make_deterministic,
    register_resolvers,
    timed_out,
    under_launcher,
)
from hydra_ddp.errors import UserError
from hydra_ddp.metrics import evaluate, memory_stats
from hydra_ddp.monitor import Monitor
from hydra_ddp.optim import param_groups
from hydra_ddp.preemption import (
    Preempted,
    StopOnSignal,
    exit_with_parent,
    run_dir_override,
    signal_name,
)
from hydra_ddp.profiling import step_profiler
from hydra_ddp.tracking import RunInfo, make_tracker

log = logging.getLogger(__name__)

register_configs()
register_resolvers()

Batch = tuple[torch.Tensor, torch.Tensor]


def train_step(
    model: torch.nn.Module,
    micro_batches: list[Batch],
    loss_fn: Callable,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    autocast: contextlib.AbstractContextManager,
    max_norm: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over `micro_batches` (gradient accumulation when more than one).

    Returns the mean loss and the gradient norm before clipping, both left on the device. A
    non-finite norm means the update was not applied (the caller decides what that means).
    """
    total_loss = torch.zeros((), device=micro_batches[0][0].device)
    for i, (x, y) in enumerate(micro_batches):
        # Gradients are all-reduced on the last micro-batch only; the others accumulate locally.
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync():
            with autocast:
                loss = loss_fn(model(x), y) / len(micro_batches)
            scaler.scale(loss).backward()
        total_loss += loss.detach()
    scaler.unscale_(optimizer)  # clip the true gradients, not the loss-scaled ones
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or math.inf)
    # fp16's scaler skips a step whose gradients overflowed by itself; otherwise a non-finite
    # norm (the same on every rank: gradients are averaged by now) skips it here.
    if scaler.is_enabled() or torch.isfinite(grad_norm):
        scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return total_loss, grad_norm


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
    """Everything `train` builds from the config before any process group exists."""

    source: DataSource
    model: torch.nn.Module
    loss_fn: Callable
    metrics: dict[str, Any]
    optimizer: torch.optim.Optimizer
    scheduler: Any


def build_components(
    cfg: TrainConfig, source: DataSource, device: torch.device, total_steps: int
) -> Components:
    """Model, loss, metrics, optimizer and schedule, each from its config group."""
    model = build(cfg.model, "model", **source.spec).to(device)
    optimizer = build(cfg.optim, "optim", params=param_groups(model))
    return Components(
        source=source,
        model=model,
        loss_fn=build(cfg.loss, "loss"),
        metrics={name: build(m, f"metrics.{name}") for name, m in cfg.metrics.items()},
        optimizer=optimizer,
        scheduler=build(cfg.scheduler, "scheduler", optimizer=optimizer, total_steps=total_steps),
    )


def train(cfg: TrainConfig, env: DistEnv, run: RunInfo) -> dict[str, Any]:
    """Run one rank's share of the job and return the job summary (same on every rank)."""
    tcfg = cfg.trainer
    console = Console(env, enabled=tcfg.progress)
    console.quiet_other_ranks()

    # Everything that can fail on bad input happens before the process group starts.
    monitor = Monitor(tcfg, sweeps.monitor_key(cfg))
    if tcfg.deterministic:
        make_deterministic()
    torch.manual_seed(tcfg.seed)
    source = build(cfg.data, "data")
    train_data = TrainData(
        source, cfg.sampler, env, tcfg.batch_size, cfg.sampler_seed, tcfg.num_workers
    )
    evals = {
        s: EvalData(source, s, cfg.sampler.policy, env, tcfg.batch_size) for s in ("val", "test")
    }
    steps_per_epoch = _epoch_length(train_data.steps_per_epoch, tcfg)
    total_steps = (
        tcfg.max_steps
        if tcfg.max_steps > 0
        else max(tcfg.epochs * steps_per_epoch // tcfg.grad_accum, 1)
    )
    parts = build_components(cfg, source, env.device, total_steps)
    raw_model, opt, sched = parts.model, parts.optimizer, parts.scheduler
    scaler = torch.amp.GradScaler(env.device.type, enabled=tcfg.precision == Precision.fp16)
    # nanoGPT's idiom: in fp32 no autocast context is entered at all.
    autocast = (
        contextlib.nullcontext()
        if tcfg.precision == Precision.fp32
        else torch.autocast(
            env.device.type,
            dtype=torch.bfloat16 if tcfg.precision == Precision.bf16 else torch.float16,
        )
    )
    # The average is evaluated and checkpointed; the raw weights keep training.
    ema = (
        AveragedModel(
            raw_model, multi_avg_fn=get_ema_multi_avg_fn(tcfg.ema_decay), use_buffers=True
        )
        if tcfg.ema_decay
        else None
    )
    eval_model = raw_model if ema is None else ema.module
    state = {
        "model": raw_model,
        "optimizer": opt,
        "scheduler": sched,
        "scaler": scaler,
        "monitor": monitor,
        **({"ema": ema} if ema is not None else {}),
    }
    checkpoint.check_folder(run.output_dir)
    resume_from = checkpoint.resolve_resume(tcfg.resume, run.output_dir)

    if env.launched:
        exit_with_parent()
    init_process_group(env, cfg.dist)
    tracker = model = step_model = None
    stopper = StopOnSignal(env)
    scope = contextlib.ExitStack()
    try:
        model = wrap_model(raw_model, env, cfg.ddp)
        # Compiled after the DDP wrap, as torch's DDP docs recommend: dynamo's DDPOptimizer then
        # splits the graph at DDP's bucket boundaries, so each bucket's all-reduce still starts
        # while the backward of the earlier layers runs. Checkpoints keep using raw_model, so
        # their keys carry no `_orig_mod.` prefix.
        step_model = torch.compile(model) if tcfg.compile else model
        pos = Position()
        if resume_from is not None:
            pos = Position(
                **checkpoint.restore_training_state(
                    resume_from, env, [f.name for f in fields(Position)], **state
                )
            )
            if pos.batch_in_epoch >= steps_per_epoch:  # saved by more ranks
                pos.epoch, pos.batch_in_epoch = pos.epoch + 1, 0
            log.info(
                "resumed from %s at step %d (epoch %d, batch %d)",
                resume_from,
                pos.step,
                pos.epoch,
                pos.batch_in_epoch,
            )
            finished = _finished_summary(run.output_dir, pos.step, total_steps, env)
            if finished is not None:
                return finished
        else:
            # Different dropout masks per rank; the weights are already equal (same seed, and
            # DDP broadcasts rank 0's at construction).
            torch.manual_seed(tcfg.seed + env.rank)

        tracker = make_tracker(
            cfg.logger, env, run, resumed_step=pos.step if resume_from is not None else None
        )
        console.show_config(run.config)
        unit = source.unit
        log.info(
            "%d rank(s) | %d train rows held by rank %d (%.1f MiB) | %d steps/epoch | %d steps",
            env.world_size,
            train_data.rows_held,
            env.rank,
            train_data.bytes_held / 2**20,
            steps_per_epoch,
            total_steps,
        )
        if tcfg.detect_anomaly:
            log.warning(
                "autograd anomaly detection is on (trainer.detect_anomaly): several times slower"
            )
            scope.enter_context(torch.autograd.detect_anomaly())
        profiler = scope.enter_context(step_profiler(tcfg, env, run.output_dir))

        batches = _batches(train_data, pos, tcfg)
        scoring = (parts.loss_fn, parts.metrics, autocast, tcfg.limit_eval_batches)
        window = _Window()
        val: dict[str, float] = {}
        t_start = time.perf_counter()
        start_step = pos.step
        progress = console.progress(total_steps, pos.step)
        model.train()
        stopper.start()
        while pos.step < total_steps:
            signum = stopper.agreed()
            if signum:
                progress.close()
                checkpoint.save_training_state(
                    run.output_dir, asdict(pos), tcfg.keep_ckpts, env, **state
                )
                tracker.close(preempted=True)
                tracker = None
                stopper.chain()
                raise Preempted(
                    signum,
                    f"stopped on {signal_name(signum)} at step {pos.step} of {total_steps} with "
                    "a checkpoint: re-run the same command with "
                    f"{run_dir_override(run.output_dir)} to resume (a SLURM or submitit "
                    "requeue does so by itself)",
                )
            t_step = time.perf_counter()
            micro_batches = [next(batches) for _ in range(tcfg.grad_accum)]
            window.data_wait += time.perf_counter() - t_step
            micro_batches = [
                (x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True))
                for x, y in micro_batches
            ]
            loss, grad_norm = train_step(
                step_model, micro_batches, parts.loss_fn, opt, scaler, autocast, tcfg.grad_clip
            )
            if not scaler.is_enabled() and not torch.isfinite(grad_norm):
                _non_finite(pos.step + 1, loss, env, tcfg.nan_policy)
            sched.step()
            if ema is not None:
                ema.update_parameters(raw_model)
            profiler.step()
            pos.step += 1
            rows = sum(len(x) for x, _ in micro_batches)
            pos.samples_seen += rows
            window.samples += rows * source.items_per_row
            window.add_step(loss, time.perf_counter() - t_step)
            progress.advance()

            if pos.step % tcfg.log_interval == 0 or pos.step == total_steps:
                stats = window.flush(grad_norm, sched.get_last_lr()[0], unit)
                stats.update(
                    memory_stats(env.device),
                    samples_seen=pos.samples_seen,
                    data_rows=train_data.rows_held,
                    data_bytes=train_data.bytes_held,
                    epoch=pos.epoch,
                )
                tracker.log(pos.step, stats)
                progress.describe(f"loss {stats['loss']:.4f}")
                if env.is_main and not progress.visible:
                    console.log_step(pos.step, total_steps, stats, tracker.last_aggregate, unit)
            if _due(pos.step, tcfg.eval_interval, total_steps):
                val = evaluate(eval_model, evals["val"], env, *scoring)
                tracker.log_eval(pos.step, {f"val/{k}": v for k, v in val.items()})
                console.info_main("step %d | val %s", pos.step, _fmt(val))
                if monitor.update(pos.step, val, env):
                    checkpoint.save_training_state(
                        run.output_dir, asdict(pos), 1, env, name="best.pt", **state
                    )
                elif monitor.should_stop:
                    monitor.stop(pos.step)
                    break
            if _due(pos.step, tcfg.ckpt_interval, total_steps):
                checkpoint.save_training_state(
                    run.output_dir, asdict(pos), tcfg.keep_ckpts, env, **state
                )
        stopper.finish()
        progress.close()
        wall = time.perf_counter() - t_start

        # The last validation goes into the monitor before the last checkpoint, so a run
        # resumed from it (a longer one) continues with the right best score and patience.
        improved = False
        if not monitor.stopped_early:  # else the loop evaluated this very step already
            val = evaluate(eval_model, evals["val"], env, *scoring)
            improved = monitor.update(pos.step, val, env)
        checkpoint.save_training_state(run.output_dir, asdict(pos), tcfg.keep_ckpts, env, **state)
        if improved and env.is_main:
            checkpoint.keep_as_best(run.output_dir, pos.step)
        test = evaluate(eval_model, evals["test"], env, *scoring)
        tracker.log_eval(
            pos.step,
            {
                **{f"val/{k}": v for k, v in val.items()},
                **{f"test/{k}": v for k, v in test.items()},
            },
        )
        summary = _summary(
            cfg, env, pos, start_step, wall, window, val, test, train_data, steps_per_epoch, unit
        )
        summary.update(monitor.summary())
        tracker.summary({k: v for k, v in summary.items() if isinstance(v, (int, float))})
        if env.is_main:
            path = run.output_dir / "summary.json"
            path.write_text(json.dumps(_json_safe(summary), indent=2) + "\n")
            # An earlier attempt of this job that failed (a sweep job re-run here) is over.
            (run.output_dir / "failure.json").unlink(missing_ok=True)
        console.show_summary(summary, run.output_dir)
        tracker.close()
        barrier(env)
        return summary
    except BaseException as e:
        # The failed step's frames (kept alive by the traceback) hold the DDP wrapper: free
        # it now, while the process group is up (see the finally below for why that matters).
        traceback.clear_frames(e.__traceback__)
        if tracker is not None:
            tracker.close(failed=True)
        if isinstance(e, Preempted):
            raise
        explained = explain(e)
        if explained is not None:
            raise explained from e
        if lost_peer(e):
            # Every survivor of a dead rank gets the same collective traceback, which says
            # nothing about the cause: one line instead.
            raise UserError(
                f"rank {env.rank} lost contact with another rank "
                f"({_first_line(e)}): that rank most likely died, "
                "see its log for why; with torchrun --max-restarts=K (or dist.max_restarts=K) "
                "the group restarts and resumes from the newest checkpoint"
            ) from e
        if isinstance(e, OSError) and e.errno in _WRITE_ERRNOS:
            raise UserError(
                f"could not write {e.filename or run.output_dir} ({e.strerror}): free space "
                "or quota there, or resume in another dir (hydra.run.dir=...); the checkpoints "
                "already written are intact"
            ) from e
        if timed_out(e):
            raise UserError(
                f"rank {env.rank} waited dist.timeout_s={cfg.dist.timeout_s:g}s for another "
                f"rank in a collective ({_first_line(e)}): a rank stopped answering (stopped, "
                "hung on I/O, or far slower than the others), see the other ranks' logs; raise "
                "dist.timeout_s if one rank legitimately works that long alone"
            ) from e
        raise
    finally:
        scope.close()
        stopper.restore()
        # The DDP wrapper goes first, while the process group is still registered: dropping the
        # group's last reference in the wrapper's deallocation joins gloo's threads with the GIL
        # held, which deadlocks when one of them still frees a tensor (seen under load).
        model = step_model = None  # noqa: F841
        destroy_process_group()


_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def _first_line(e: BaseException) -> str:
    """The gist of a c10d/gloo error: its first sentence, without the source location."""
    line = str(e).splitlines()[0] if str(e) else type(e).__name__
    if line.startswith("[") and "] " in line:
        line = line.split("] ", 1)[1]
    return line.split(". ")[0][:200]


def _finished_summary(
    output_dir: Path, step: int, total_steps: int, env: DistEnv
) -> dict[str, Any] | None:
    """The earlier summary when the checkpoint resumed from already ends the run, else None.

    Rank 0 reads it and every rank returns the same, so no rank trains alone on an output dir
    that another node cannot see."""
    path = output_dir / "summary.json"
    found = json.loads(path.read_text()) if step >= total_steps and path.is_file() else None
    found = all_gather_objects(found if env.is_main else None, env)[0]
    if found is not None and env.is_main:
        log.info(
            "already complete at step %d of %d: nothing to do (%s); retrain with "
            "trainer.resume=never or in a new output dir",
            step,
            total_steps,
            path,
        )
    return found


def _epoch_length(batches: int, tcfg: Any) -> int:
    """Batches per epoch and rank, after trainer.overfit_batches / limit_train_batches."""
    if tcfg.overfit_batches:
        return min(tcfg.overfit_batches, batches)
    return min(tcfg.limit_train_batches, batches) if tcfg.limit_train_batches else batches


def _batches(data: TrainData, pos: Position, tcfg: Any) -> Iterator[Batch]:
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


def _due(step: int, interval: int, total_steps: int) -> bool:
    """An every-`interval`-steps action (0: never) that the end of the run does anyway."""
    return bool(interval) and step % interval == 0 and step < total_steps


class _Window:
    """Per-rank sums between two log points."""

    def __init__(self) -> None:
        self.reset()
        self.last_loss = float("nan")
        self.total_samples = 0
        self.total_time = 0.0

    def reset(self) -> None:
        self.loss: torch.Tensor | float = 0.0
        self.steps = 0
        self.step_time = self.data_wait = 0.0
        self.samples = 0

    def add_step(self, loss: torch.Tensor, seconds: float) -> None:
        # Kept on the device: reading it every step would force a GPU sync per step.
        self.loss = loss if self.steps == 0 else self.loss + loss
        self.steps += 1
        self.step_time += seconds

    def flush(self, grad_norm: torch.Tensor, lr: float, unit: str) -> dict[str, float]:
        """This window's per-step means and throughput; starts the next window."""
        steps = max(self.steps, 1)
        self.last_loss = float(self.loss) / steps
        self.total_samples += self.samples
        self.total_time += self.step_time
        stats = {
            "loss": self.last_loss,
            "step_time": self.step_time / steps,
            "data_wait": self.data_wait / steps,
            f"{unit}_per_s": self.samples / max(self.step_time, 1e-9),
            "grad_norm": float(grad_norm),
            "lr": lr,
        }
        self.reset()
        return stats


def _non_finite(step: int, loss: torch.Tensor, env: DistEnv, policy: NanPolicy) -> None:
    """Name the rank(s) whose loss went non-finite; stop or skip as configured."""
    flags = all_gather_floats([0.0 if torch.isfinite(loss) else 1.0], env)
    ranks = [r for r, (flag,) in enumerate(flags) if flag > 0]
    if ranks:
        what = f"non-finite loss at step {step} on rank(s) {', '.join(map(str, ranks))}"
    else:
        what = (
            f"non-finite gradients at step {step} on every rank (the loss was finite on all "
            "ranks; the averaged gradient overflowed)"
        )
    if policy == NanPolicy.stop:
        raise UserError(
            f"{what}: lower optim.lr, enable trainer.grad_clip, check the data those "
            "ranks read, or set trainer.nan_policy=skip to drop such steps"
        )
    log.warning("skipping step %d (trainer.nan_policy=skip): %s", step, what)


def _summary(
    cfg: TrainConfig,
    env: DistEnv,
    pos: Position,
    start_step: int,
    wall: float,
    window: _Window,
    val: dict[str, float],
    test: dict[str, float],
    data: TrainData,
    steps_per_epoch: int,
    unit: str,
) -> dict[str, Any]:
    samples = all_reduce_sum([float(window.total_samples)], env)[0]
    held = all_gather_floats([data.rows_held, data.bytes_held], env)
    summary: dict[str, Any] = {
        "world_size": env.world_size,
        "steps": pos.step,
        "steps_this_run": pos.step - start_step,
        "epochs": pos.epoch + (pos.batch_in_epoch / max(steps_per_epoch, 1)),
        "train_loss": all_reduce_sum([window.last_loss], env)[0] / env.world_size,
        f"{unit}_per_s": samples / max(wall, 1e-9),
        "wall_time_s": wall,
        "rows_held_per_rank": [int(h[0]) for h in held],
        "bytes_held_per_rank": [int(h[1]) for h in held],
        "sampler": cfg.sampler.policy.value,
        "objective": val[sweeps.monitor_key(cfg)],  # trainer.monitor
    }
    # val_loss, val_acc, test_ppl, ...: the loss and every configured metric of both splits.
    for split, metrics in (("val", val), ("test", test)):
        summary.update({f"{split}_{k}": v for k, v in metrics.items()})
    return summary


def _json_safe(summary: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN or inf: such metrics are written as null, with a warning."""
    bad = [k for k, v in summary.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        log.warning("not finite, written as null in summary.json: %s", ", ".join(bad))
    return {k: None if k in bad else v for k, v in summary.items()}


def _fmt(metrics: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.4f}" for k, v in metrics.items())


# --------------------------------------------------------------------------------------------
# Entry
# --------------------------------------------------------------------------------------------


def to_typed(dict_cfg: DictConfig) -> TrainConfig:
    """The composed config as dataclasses; runs every __post_init__ check."""
    # `+trainer.x=1` adds a key even to a typed group, where it would be silently ignored.
    for f in fields(TrainConfig):
        node = dict_cfg.get(f.name)
        if not isinstance(node, DictConfig):
            continue
        schema = OmegaConf.get_type(node)
        if schema is not None and dataclasses.is_dataclass(schema):
            known = {k.name for k in fields(schema)}
            extra = sorted(set(node.keys()) - known)
            if extra:
                raise UserError(
                    f"{f.name}.{extra[0]} is not a key of {f.name} "
                    f"({schema.__name__}; see src/hydra_ddp/config.py): check the "
                    f"spelling, its keys are {', '.join(sorted(known))}"
                )
    return OmegaConf.to_object(dict_cfg)  # type: ignore[return-value]


def preflight(cfg: TrainConfig, world_size: int) -> None:
    """Checks that need the data and the components but no process group, so a bad job fails
    once, in the launching process, instead of once per worker."""
    sweeps.monitor_key(cfg)  # trainer.monitor names a metric the job computes
    source = build(cfg.data, "data")
    check_sampling(source, cfg.sampler, world_size, cfg.trainer.batch_size)
    build_components(cfg, source, torch.device("cpu"), total_steps=1)


def run_info(dict_cfg: DictConfig) -> RunInfo:
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    output_dir = Path(hc.runtime.output_dir)
    if multirun:
        name = hc.job.override_dirname or f"job{hc.job.num}"
        group = "sweep-" + "-".join(Path(hc.sweep.dir).parts[-2:])
    else:
        name = hc.job.override_dirname or hc.job.name
        group = "-".join(output_dir.parts[-2:])
    config = OmegaConf.to_container(dict_cfg, resolve=True, enum_to_str=True)
    return RunInfo(output_dir=output_dir, job_name=name, group=group, config=config)


def config_dir() -> str:
    """The configs: conf/ at the top of a checkout (an editable install, or src/ on PYTHONPATH),
    so an edit there counts at the next run; else the copy a wheel ships as hydra_ddp/conf
    (pyproject.toml's package-dir), so an installed `hydra-ddp-train` runs from any folder."""
    here = Path(__file__).resolve().parent
    checkout = here.parent.parent / "conf"
    if here.parent.name == "src" and (checkout / "train.yaml").is_file():
        return str(checkout)
    return str(here / "conf")


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="train")
def hydra_entry(dict_cfg: DictConfig) -> float:
    """Compose, validate, then train here or start a worker group; returns the objective
    (validation loss) for Hydra sweepers."""
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    run = run_info(dict_cfg)
    try:
        cfg = to_typed(dict_cfg)
        if multirun and "TORCHELASTIC_RUN_ID" in os.environ:
            raise UserError(
                "a sweep (-m) under torchrun would run the whole sweep on every rank: "
                "run `python -m hydra_ddp.train -m dist.nproc_per_node=N ...` instead"
            )
        if cfg.dist.nproc_per_node > 1 and not under_launcher():
            preflight(cfg, cfg.dist.nproc_per_node)
            summary = launch.spawn(train, cfg, run)
        else:
            export_submitit_env()
            summary = train(cfg, env_from_environ(cfg.dist), run)
        return float(summary["objective"])
    except Preempted as e:
        # Also ends a sweep: the jobs after this one would be stopped the same way.
        (log.warning if launcher_rank() == 0 else log.info)("%s", e)
        sys.exit(e.exit_code)
    except UserError as e:
        log.error("error: %s", e)
        if not multirun:
            sys.exit(2)
        # Let the sweep go on: the report at its end lists this job as failed, and a NaN
        # objective marks the trial failed for sweepers such as Optuna's.
        sweeps.record_failure(run.output_dir, str(e))
        return float("nan")
    except Exception as e:
        if not multirun:
            raise
        log.exception("job failed")
        sweeps.record_failure(run.output_dir, f"{type(e).__name__}: {e}")
        return float("nan")


def _check_run_dir(argv: list[str]) -> None:
    """`hydra.run.dir=<path>` on the command line that cannot be created (read-only disk, no
    permission): one line here, instead of the traceback of Hydra's mkdir."""
    given = [a.split("=", 1)[1] for a in argv if a.startswith("hydra.run.dir=")]
    if not given or "${" in given[-1] or any(a in ("-m", "--multirun") for a in argv):
        return
    try:
        os.makedirs(given[-1], exist_ok=True)
    except OSError as e:
        sys.stderr.write(
            f"error: hydra.run.dir={given[-1]} cannot be created ({e.strerror}): choose a "
            "writable place\n"
        )
        sys.exit(2)


def main() -> None:
    _check_run_dir(sys.argv[1:])
    try:
        hydra_entry()
        code = 1 if sweeps.sweep_failed() else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if under_launcher():
        # Everything is written and the process group is gone, but at interpreter teardown a
        # rank can still abort ("terminate called without an active exception": a c10d/gloo
        # thread destroyed while joinable), turning a finished job into a failed one for
        # torchrun. Leave without running C++ static destructors.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
