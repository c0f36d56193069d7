"""The Hydra entry point and the training loop.

    torchrun --standalone --nproc_per_node=2 -m hydra_ddp.train            # torchrun starts ranks
    python -m hydra_ddp.train dist.nproc_per_node=2                        # the job starts them
    python -m hydra_ddp.train -m dist.nproc_per_node=2 model=mlp,cnn       # a sweep of DDP jobs

`hydra_entry` composes and validates the config, then either trains in this process (one rank
of whatever launcher started it, or a single process) or starts its own worker group with
torch's elastic agent (see launch.py). `train` is one rank's whole job, top to bottom.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from hydra_ddp import checkpoint, launch
from hydra_ddp.config import NanPolicy, Precision, TrainConfig, register_configs
from hydra_ddp.console import Console
from hydra_ddp.data import EvalData, Split, Task, TrainData, build_source, check_sampling
from hydra_ddp.dist import (DistEnv, destroy_process_group, env_from_environ,
                            export_submitit_env, init_process_group, lost_peer,
                            register_resolvers, under_launcher, unwrap, wait_for_all_ranks,
                            wrap_model)
from hydra_ddp.errors import UserError
from hydra_ddp.metrics import all_reduce_sum, evaluate, memory_stats
from hydra_ddp.models import build_model, train_loss
from hydra_ddp.optim import GradClipper, build_optimizer, build_scheduler
from hydra_ddp.tracking import RunInfo, make_tracker

log = logging.getLogger(__name__)

register_configs()
register_resolvers()


@dataclass
class Position:
    """Where the loop is: saved in checkpoints so a resumed run continues mid-epoch."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of this epoch already trained on
    samples_seen: int = 0  # by this rank


def train(cfg: TrainConfig, env: DistEnv, run: RunInfo) -> dict[str, Any]:
    """Run one rank's share of the job and return the job summary (same on every rank)."""
    tcfg = cfg.trainer
    console = Console(env, enabled=tcfg.progress)
    console.quiet_other_ranks()

    # Everything that can fail on bad input happens before the process group starts.
    torch.manual_seed(tcfg.seed)
    source = build_source(cfg.data)
    train_data = TrainData(source, cfg.sampler, env, tcfg.batch_size, cfg.data.in_memory,
                           cfg.sampler_seed, tcfg.num_workers)
    evals = {s: EvalData(source, s, cfg.sampler.policy, env, tcfg.batch_size, cfg.data.in_memory)
             for s in (Split.val, Split.test)}
    model = build_model(cfg.model, source.spec)
    resume_from = checkpoint.resolve_resume(tcfg.resume, run.output_dir)

    init_process_group(env, cfg.dist)
    tracker = None
    try:
        model = wrap_model(model, env, cfg.ddp)
        raw_model = unwrap(model)
        opt = build_optimizer(raw_model, cfg.optim)
        steps_per_epoch = train_data.steps_per_epoch
        total_steps = (tcfg.max_steps if tcfg.max_steps > 0
                       else max(tcfg.epochs * steps_per_epoch // tcfg.grad_accum, 1))
        sched = build_scheduler(opt, cfg.optim, total_steps)
        scaler = torch.amp.GradScaler(env.device.type,
                                      enabled=tcfg.precision == Precision.fp16)
        autocast_dtype = {Precision.bf16: torch.bfloat16,
                          Precision.fp16: torch.float16}.get(tcfg.precision)
        # In fp32 neither autocast nor the scaler is entered at all: on a small model their
        # disabled-path calls cost a few percent of a step.
        autocast = (torch.autocast(env.device.type, dtype=autocast_dtype)
                    if autocast_dtype is not None else contextlib.nullcontext())
        scaling = scaler.is_enabled()
        clip = GradClipper(raw_model, tcfg.grad_clip)

        pos = Position()
        if resume_from is not None:
            pos = _restore(resume_from, raw_model, opt, sched, scaler, env)
            log.info("resumed from %s at step %d (epoch %d, batch %d)", resume_from, pos.step,
                     pos.epoch, pos.batch_in_epoch)
        else:
            # Different dropout masks per rank; the weights are already equal (same seed, and
            # DDP broadcasts rank 0's at construction).
            torch.manual_seed(tcfg.seed + env.rank)

        tracker = make_tracker(cfg.logger, env, run)
        console.show_config(run.config)
        is_lm = source.spec.task == Task.language_model
        unit = "tokens" if is_lm else "samples"
        per_sample = source.spec.block_size if is_lm else 1
        log.info("%d rank(s) | %d %s rows held by rank %d (%.1f MiB) | %d steps/epoch | "
                 "%d steps", env.world_size, train_data.rows_held, "train", env.rank,
                 train_data.bytes_held / 2**20, steps_per_epoch, total_steps)

        batches = train_data.epoch(pos.epoch, pos.batch_in_epoch)
        window = _Window()
        last_eval: dict[str, float] = {}
        t_start = time.perf_counter()
        start_step = pos.step
        progress = console.progress(total_steps, pos.step)
        model.train()
        # The ~400k objects made by imports and setup live for the whole job: a full garbage
        # collection in the loop would walk them all (~0.2 s, a long stall for every rank).
        gc.freeze()
        while pos.step < total_steps:
            t_step = time.perf_counter()
            step_loss: torch.Tensor | None = None  # the step's mean loss, left on the device
            for micro in range(tcfg.grad_accum):
                t_wait = time.perf_counter()
                batch = next(batches, None)
                if batch is None:  # end of epoch: the sampler reshuffles for the next one
                    pos.epoch, pos.batch_in_epoch = pos.epoch + 1, 0
                    batches = train_data.epoch(pos.epoch, 0)
                    batch = next(batches)
                window.data_wait += time.perf_counter() - t_wait
                x, y = (t.to(env.device, non_blocking=True) for t in batch)
                pos.batch_in_epoch += 1
                pos.samples_seen += len(x)
                window.samples += len(x) * per_sample
                # Only the last micro-step all-reduces gradients; the others accumulate locally.
                last_micro = micro == tcfg.grad_accum - 1
                sync = contextlib.nullcontext() if last_micro or not hasattr(model, "no_sync") \
                    else model.no_sync()
                with sync:
                    with autocast:
                        loss = train_loss(_forward(model, x), y)
                    if tcfg.grad_accum > 1:
                        loss = loss / tcfg.grad_accum
                    (scaler.scale(loss) if scaling else loss).backward()
                step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
            if scaling:
                scaler.unscale_(opt)  # clip the true gradients, not the scaled ones
            grad_norm = clip()
            if scaling:
                scaler.step(opt)  # skips the step itself when the gradients overflowed
                scaler.update()
            elif math.isfinite(grad_norm):
                opt.step()
            else:
                # Gradients are already averaged over ranks here, so every rank sees the same
                # norm and takes the same decision without another collective.
                _non_finite(pos.step + 1, step_loss, env, cfg.trainer.nan_policy)
            opt.zero_grad(set_to_none=True)
            sched.step()
            pos.step += 1
            window.add_step(step_loss, time.perf_counter() - t_step)
            progress.advance()

            if pos.step % tcfg.log_interval == 0 or pos.step == total_steps:
                stats = window.flush(grad_norm, sched.get_last_lr()[0], unit)
                stats.update(memory_stats(env.device), samples_seen=pos.samples_seen,
                             data_rows=train_data.rows_held, data_bytes=train_data.bytes_held,
                             epoch=pos.epoch)
                tracker.log(pos.step, stats)
                progress.describe(f"loss {stats['loss']:.4f}")
                if env.is_main and not progress.visible:
                    console.log_step(pos.step, total_steps, stats, tracker.last_aggregate, unit)
            if tcfg.eval_interval and pos.step % tcfg.eval_interval == 0 \
                    and pos.step < total_steps:
                last_eval = evaluate(raw_model, evals[Split.val], env, source.spec.task, autocast)
                tracker.log_eval(pos.step, {f"val/{k}": v for k, v in last_eval.items()})
                console.info_main("step %d | val %s", pos.step, _fmt(last_eval))
            if tcfg.ckpt_interval and pos.step % tcfg.ckpt_interval == 0 \
                    and pos.step < total_steps:
                _save(pos, raw_model, opt, sched, scaler, env, run.output_dir, tcfg.keep_ckpts)
        progress.close()
        wall = time.perf_counter() - t_start

        _save(pos, raw_model, opt, sched, scaler, env, run.output_dir, tcfg.keep_ckpts)
        val = evaluate(raw_model, evals[Split.val], env, source.spec.task, autocast)
        test = evaluate(raw_model, evals[Split.test], env, source.spec.task, autocast)
        tracker.log_eval(pos.step, {**{f"val/{k}": v for k, v in val.items()},
                                    **{f"test/{k}": v for k, v in test.items()}})
        summary = _summary(cfg, env, pos, start_step, wall, window, val, test, train_data, unit,
                           per_sample)
        tracker.summary({k: v for k, v in summary.items() if isinstance(v, (int, float))})
        if env.is_main:
            path = run.output_dir / "summary.json"
            path.write_text(json.dumps(summary, indent=2) + "\n")
        console.show_summary(summary, run.output_dir)
        tracker.close()
        wait_for_all_ranks(env)
        return summary
    except BaseException as e:
        if tracker is not None:
            tracker.close(failed=True)
        if lost_peer(e):
            # Every survivor of a dead rank gets the same collective traceback, which says
            # nothing about the cause: one line instead.
            raise UserError(
                f"rank {env.rank} lost contact with another rank "
                f"({str(e).splitlines()[0].split('. ')[0][:200]}): that rank most likely died, "
                "see its log for why; with torchrun --max-restarts=K (or dist.max_restarts=K) "
                "the group restarts and resumes from the newest checkpoint") from e
        raise
    finally:
        gc.unfreeze()  # a sweep's next job in this process must be able to collect this one
        destroy_process_group()


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
        steps = max(self.steps, 1)
        self.last_loss = float(self.loss) / steps
        self.total_samples += self.samples
        self.total_time += self.step_time
        stats = {"loss": self.last_loss, "step_time": self.step_time / steps,
                 "data_wait": self.data_wait / steps,
                 f"{unit}_per_s": self.samples / max(self.step_time, 1e-9),
                 "grad_norm": float(grad_norm), "lr": lr}
        self.reset()
        return stats


def _forward(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    try:
        return model(x)
    except RuntimeError as e:
        # DDP's own message for this case is a paragraph about reductions and buckets.
        if "Expected to have finished reduction" in str(e):
            raise UserError("some model parameters got no gradient in a step and DDP was not "
                            "told to expect that: use ddp=unused_params (sets "
                            "ddp.find_unused_parameters=true), or make every parameter take "
                            "part in the loss") from e
        raise


def _non_finite(step: int, loss_sum: torch.Tensor, env: DistEnv, policy: NanPolicy) -> None:
    """Name the rank(s) whose loss went non-finite; stop or skip as configured."""
    flags = torch.tensor([0.0 if torch.isfinite(loss_sum) else 1.0], dtype=torch.float64,
                         device=env.device)
    if env.distributed:
        gathered = [torch.zeros_like(flags) for _ in range(env.world_size)]
        dist.all_gather(gathered, flags)
        ranks = [r for r, f in enumerate(gathered) if f.item() > 0]
    else:
        ranks = [0] if flags.item() > 0 else []
    if ranks:
        what = f"non-finite loss at step {step} on rank(s) {', '.join(map(str, ranks))}"
    else:
        what = (f"non-finite gradients at step {step} on every rank (the loss was finite on all "
                "ranks; the averaged gradient overflowed)")
    if policy == NanPolicy.stop:
        raise UserError(f"{what}: lower optim.lr, enable trainer.grad_clip, check the data those "
                        "ranks read, or set trainer.nan_policy=skip to drop such steps")
    log.warning("skipping step %d (trainer.nan_policy=skip): %s", step, what)


def _save(pos: Position, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any,
          scaler: torch.amp.GradScaler, env: DistEnv, output_dir: Path, keep: int) -> None:
    """Gather every rank's RNG state, then global rank 0 alone writes the file."""
    rng = {"torch": torch.get_rng_state()}
    if env.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(env.device)
    rngs: list[Any] = [rng]
    if env.distributed:
        rngs = [None] * env.world_size
        dist.all_gather_object(rngs, rng)
    if env.is_main:
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                 "scheduler": sched.state_dict(), "scaler": scaler.state_dict(),
                 "step": pos.step, "epoch": pos.epoch, "batch_in_epoch": pos.batch_in_epoch,
                 "samples_seen": pos.samples_seen, "world_size": env.world_size, "rng": rngs}
        path = checkpoint.save(state, output_dir, pos.step, keep)
        log.info("checkpoint: %s", path)
    if env.distributed:
        # Nobody races ahead and dies before the file is complete.
        dist.barrier()


def _restore(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any,
             scaler: torch.amp.GradScaler, env: DistEnv) -> Position:
    state = checkpoint.load(path)
    checkpoint.load_model_state(model, state, path)
    try:
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        pos = Position(step=int(state["step"]), epoch=int(state["epoch"]),
                       batch_in_epoch=int(state["batch_in_epoch"]),
                       samples_seen=int(state.get("samples_seen", 0)))
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise UserError(f"{path} does not match this job's optimizer/scheduler setup "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): "
                        "resume with the optim.* config it was trained with, or "
                        "trainer.resume=never") from e
    if state.get("world_size") != env.world_size:
        log.warning("%s was written by %s ranks, this job has %d: the rest of its epoch is "
                    "partitioned differently", path, state.get("world_size"), env.world_size)
    rngs = state.get("rng") or []
    if env.rank < len(rngs):
        torch.set_rng_state(rngs[env.rank]["torch"].cpu())
        if env.device.type == "cuda" and "cuda" in rngs[env.rank]:
            torch.cuda.set_rng_state(rngs[env.rank]["cuda"].cpu(), env.device)
    return pos


def _summary(cfg: TrainConfig, env: DistEnv, pos: Position, start_step: int, wall: float,
             window: _Window, val: dict[str, float], test: dict[str, float], data: TrainData,
             unit: str, per_sample: int) -> dict[str, Any]:
    samples = all_reduce_sum([float(window.total_samples), float(data.rows_held),
                              float(data.bytes_held)], env)
    held = _gather_ints([data.rows_held, data.bytes_held], env)
    summary: dict[str, Any] = {
        "world_size": env.world_size,
        "steps": pos.step,
        "steps_this_run": pos.step - start_step,
        "epochs": pos.epoch + (pos.batch_in_epoch / max(data.steps_per_epoch, 1)),
        "train_loss": all_reduce_sum([window.last_loss], env)[0] / env.world_size,
        "val_loss": val["loss"],
        "test_loss": test["loss"],
        f"{unit}_per_s": samples[0] / max(wall, 1e-9),
        "wall_time_s": wall,
        "rows_held_per_rank": [h[0] for h in held],
        "bytes_held_per_rank": [h[1] for h in held],
        "sampler": cfg.sampler.policy.value,
        "objective": val["loss"],
    }
    if "acc" in val:
        summary["val_acc"], summary["test_acc"] = val["acc"], test["acc"]
    return summary


def _gather_ints(values: list[int], env: DistEnv) -> list[list[int]]:
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    if not env.distributed:
        return [[int(v) for v in values]]
    out = [torch.zeros_like(t) for _ in range(env.world_size)]
    dist.all_gather(out, t)
    return [[int(v) for v in o.tolist()] for o in out]


def _fmt(metrics: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k != "count")


# --------------------------------------------------------------------------------------------
# Entry
# --------------------------------------------------------------------------------------------


def to_typed(dict_cfg: DictConfig) -> TrainConfig:
    """The composed config as dataclasses; runs every __post_init__ check."""
    return OmegaConf.to_object(dict_cfg)  # type: ignore[return-value]


def preflight(cfg: TrainConfig, world_size: int) -> None:
    """Checks that need the data and model but no process group, so a bad job fails once, in
    the launching process, instead of once per worker."""
    source = build_source(cfg.data)
    check_sampling(source, cfg.sampler, world_size, cfg.trainer.batch_size)
    build_model(cfg.model, source.spec)


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


@hydra.main(version_base="1.3", config_path="../../conf", config_name="train")
def hydra_entry(dict_cfg: DictConfig) -> float:
    """Compose, validate, then train here or start a worker group; returns the objective
    (validation loss) for Hydra sweepers."""
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    run = run_info(dict_cfg)
    try:
        cfg = to_typed(dict_cfg)
        if multirun and "TORCHELASTIC_RUN_ID" in os.environ:
            raise UserError("a sweep (-m) under torchrun would run the whole sweep on every rank: "
                            "run `python -m hydra_ddp.train -m dist.nproc_per_node=N ...` instead")
        if cfg.dist.nproc_per_node > 1 and not under_launcher():
            preflight(cfg, cfg.dist.nproc_per_node)
            summary = launch.spawn(cfg, run)
        else:
            export_submitit_env()
            summary = train(cfg, env_from_environ(cfg.dist), run)
        return float(summary["objective"])
    except UserError as e:
        log.error("error: %s", e)
        if not multirun:
            sys.exit(2)
        # Let the sweep go on: the report at its end lists this job as failed, and a NaN
        # objective marks the trial failed for sweepers such as Optuna's.
        launch.record_failure(run.output_dir, str(e))
        return float("nan")
    except Exception as e:
        if not multirun:
            raise
        log.exception("job failed")
        launch.record_failure(run.output_dir, f"{type(e).__name__}: {e}")
        return float("nan")


def main() -> None:
    try:
        hydra_entry()
        code = 1 if launch.sweep_failed() else 0
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
