"""One composed job in the process that runs it: the config typed and checked, then
`train_fn(cfg, env, run)` here or on workers it starts, and every way a job ends as an exit
status (a sweep goes on past a failed job: a NaN objective).

`python -m hydra_ddp.train dist.nproc_per_node=N` without torchrun (`spawn`): the job that
composed the config starts N workers with torch's elastic agent and hands each the finished
config, so no worker re-composes or re-resolves `${now:}`.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import signal
import sys
import uuid
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from hydra_ddp import checkpoint, redact
from hydra_ddp.components import build
from hydra_ddp.config import TrainConfig, Wrapper
from hydra_ddp.data import check_sampling, check_source
from hydra_ddp.distributed import comm_hooks
from hydra_ddp.distributed.env import env_from_environ, share_cpus_in_submitit_task
from hydra_ddp.distributed.failures import one_line, worker_failed, write_rank_error
from hydra_ddp.distributed.preemption import Preempted, rerun, signal_name
from hydra_ddp.distributed.torchrun import AGENT_LOGS, drop_stop_notes, stop_status
from hydra_ddp.errors import UserError, config_error, exit_code, sweep_under_torchrun
from hydra_ddp.launch import interrupt
from hydra_ddp.launcher_env import (
    AGENT_SIGNALS,
    RAY_JOB_ENV,
    export_submitit_env,
    launcher_rank,
    torchrun_worker,
    under_launcher,
    under_submitit,
)
from hydra_ddp.loop.evaluation import monitor_key
from hydra_ddp.protocols import Sink, missing_members
from hydra_ddp.rank_job import build_components
from hydra_ddp.rundir import claim, sweeps
from hydra_ddp.rundir.paths import swept_overrides
from hydra_ddp.tracking import RunInfo

log = logging.getLogger(__name__)

_LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
_NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_FILE_ONLY = "hydra_ddp_file_only"  # a worker's log record kept off the console
# One rank's training: train.py's `train`, or eval.py's evaluation.
TrainFn = Callable[[TrainConfig, Any, RunInfo], dict[str, Any]]


def run_composed(dict_cfg: DictConfig, train_fn: TrainFn) -> float:
    """The job's objective for sweepers; NaN for a failed job of a sweep."""
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    # A job in a process of its own (submitit, Ray): its sweep goes on collecting the others.
    collected = multirun and (under_submitit() or RAY_JOB_ENV in os.environ)
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        interrupt.let_through()  # a Ctrl-C held while this module imported (command.hydra_entry)
        run = run_info(dict_cfg)
        cfg = to_typed(dict_cfg)
        if multirun and torchrun_worker():  # set in a YAML (hydra.mode): the command line's
            raise sweep_under_torchrun()  # -m is refused before Hydra starts
        if cfg.dist.nproc_per_node > 1 and not under_launcher():
            preflight(cfg, cfg.dist.nproc_per_node)
            summary = spawn(cfg, run, train_fn)
        else:
            if cfg.ddp.wrapper == Wrapper.ddp and not under_launcher():
                # One process trains unwrapped: a hook's typo is said now, not first on N ranks.
                comm_hooks.build_comm_hook(
                    cfg.ddp.comm_hook, cfg.ddp.powersgd_rank, cfg.ddp.powersgd_start_iter, "cpu"
                )
            export_submitit_env()
            share_cpus_in_submitit_task(HydraConfig.get().launcher.get("cpus_per_task"))
            summary = train_fn(cfg, env_from_environ(cfg.dist), run)
        return float(summary["objective"])
    except Preempted as e:
        if not e.logged:
            (log.warning if launcher_rank() == 0 else log.info)("%s", e)
        if multirun:
            # FAILED under submitit (a job that was not requeued), else PREEMPTED
            sweeps.record_failure(output_dir, str(e), "FAILED" if under_submitit() else "PREEMPTED")
        if collected:
            return float("nan")
        sys.exit(e.exit_code)  # in one process a sweep ends too (command.py reports it)
    except KeyboardInterrupt:
        # Ctrl-C before the loop handles signals, or a second one: one line, not a traceback.
        if collected:
            raise
        interrupt.ignore_more()
        if launcher_rank() == 0:  # said once: before start_rank, other ranks' consoles speak
            sweep_dir = HydraConfig.get().sweep.dir if multirun else None
            log.warning("%s", stopped_line("stopped on SIGINT", output_dir, sweep_dir))
        sys.exit(interrupt.EXIT_CODE)
    except Exception as e:
        e = config_error(e) or e
        code = exit_code(e, log)
        if not multirun:
            sys.exit(code)
        why = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
        sweeps.record_failure(output_dir, why)
        if under_submitit():  # once the NaN is saved: SLURM's accounting shows the job FAILED
            atexit.register(os._exit, code)
        return float("nan")
    finally:
        claim.release_all()  # run_command's end is not each job's


def to_typed(dict_cfg: DictConfig) -> TrainConfig:
    """The composed config as dataclasses, checked. `+trainer.x=1` adds a key even to a typed
    group, where it would be silently ignored: refused."""
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
    cfg: TrainConfig = OmegaConf.to_object(dict_cfg)  # type: ignore[assignment]
    # Here, not in LoggerConfig: the schema then needs neither protocols.py nor the sink.
    if cfg.logger.sink is not None:
        sink_class(cfg.logger.sink)
    return cfg


def sink_class(sink: Any) -> type:
    """The class `logger.sink` names, checked against `hydra_ddp.protocols.Sink`."""
    if not isinstance(sink, Mapping) or not isinstance(sink.get("_target_"), str):
        raise UserError(
            f"logger.sink={sink!r} is not a sink: give null (logger=none) or a mapping with "
            "_target_ (a class meeting hydra_ddp.protocols.Sink), as conf/logger/*.yaml do"
        )
    target = sink["_target_"]
    try:
        cls = get_object(target)
    except Exception as e:
        # Hydra's message puts the cause (the ImportError) on its later lines.
        cause = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        raise UserError(
            f"logger.sink._target_={target!r} cannot be imported ({cause}): pick a logger of "
            "conf/logger/*.yaml (logger=wandb, tensorboard, none) or give the dotted path of "
            "a sink class of yours"
        ) from None
    missing = missing_members(cls, Sink)
    if not isinstance(cls, type) or missing:
        lacks = f"lacks {', '.join(missing)}" if isinstance(cls, type) else "is no class"
        raise UserError(
            f"logger.sink._target_={target!r} {lacks}: a sink is a class with log(record, "
            "step), summary(values), add_config(values) and close(failed, preempted) "
            "(hydra_ddp.protocols.Sink; subclass hydra_ddp.tracking.Sink for the defaults)"
        )
    return cls


def preflight(cfg: TrainConfig, world_size: int) -> None:
    """Checks that need the data and components but no process group: a bad job fails once, in
    the launching process, not once per worker."""
    monitor_key(cfg)  # trainer.monitor names a metric the job computes
    sink = sink_class(cfg.logger.sink) if cfg.logger.sink is not None else None
    if hasattr(sink, "check_before_launch"):  # W&B: mode=online without a login fails here, once
        sink.check_before_launch(cfg.logger)
    source = build(cfg.data, "data")
    check_source(source)
    check_sampling(source, cfg.sampler, world_size, cfg.trainer.batch_size)
    build_components(cfg, source, torch.device("cpu"), total_steps=1)
    if cfg.ddp.wrapper == Wrapper.ddp:  # a hook of the user's is built here once, not per rank
        comm_hooks.build_comm_hook(
            cfg.ddp.comm_hook, cfg.ddp.powersgd_rank, cfg.ddp.powersgd_start_iter, "cpu"
        )


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
    # The name reaches W&B: secrets blanked, jobs told apart by their number.
    blanked = ",".join(redact.overrides(name.split(",")))
    name = f"{hc.job.num}_{blanked}" if multirun and blanked != name else blanked
    overrides = list(hc.overrides.task)
    swept: dict[str, Any] = {}
    params = OmegaConf.select(hc, "sweeper.params", default=None)
    for key, value in swept_overrides(overrides, hc.sweep.dir, params) if multirun else []:
        # Typed as the job ran it (0.001 for `1e-3`); a group's choice and a secret as given.
        found = OmegaConf.select(dict_cfg, key, default=None) if "@" not in key else None
        plain = isinstance(found, (bool, int, float, str)) and value != redact.REDACTED
        swept[key] = found if plain else value
    sweep_dir = Path(hc.sweep.dir).absolute() if multirun else None
    return RunInfo(output_dir, name, group, config, overrides, swept, sweep_dir)


def spawn(
    cfg: TrainConfig,
    run: Any,
    target: Callable[..., Any],
    args: tuple = (),
    log_stem: str = "train",
) -> Any:
    """Run `target(cfg, env, run, *args)` on `cfg.dist.nproc_per_node` local workers, each
    logging to <log_stem>_rank<r>.log; rank 0's result. `target`: a module's function."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if "OMP_NUM_THREADS" not in os.environ:
        # As torchrun: N full-size OpenMP pools on the same cores fight over them.
        os.environ["OMP_NUM_THREADS"] = "1"
    errors = Path(run.output_dir) / "errors"
    errors.mkdir(parents=True, exist_ok=True)
    for old in errors.glob("rank*.txt"):
        old.unlink()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.dist.nproc_per_node,
        run_id=f"hydra-ddp-{uuid.uuid4().hex[:12]}",
        # c10d rendezvous on a free local port, as `torchrun --standalone` does.
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=cfg.dist.max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
        # Forwarded, waiting for the workers' checkpoint; one not handled (torch leaves out
        # USR1 and USR2) would kill the agent before the workers save.
        signals_to_handle=AGENT_SIGNALS,
    )
    log.info(
        "starting %d workers (max_restarts=%d); logs: %s",
        cfg.dist.nproc_per_node,
        cfg.dist.max_restarts,
        Path(run.output_dir) / f"{log_stem}_rank*.log",
    )
    # A fresh store from worker rank 0 at every attempt, not the agent's, which outlives
    # restarts: there a restarted rank can read the last attempt's addresses and hang
    # (pytorch/pytorch#135712). The job dir is decided already: nothing needs the agent's.
    saved = os.environ.get(_NO_SHARED_STORE)
    os.environ[_NO_SHARED_STORE] = "1"
    # The agent logs a failed worker with a traceback of its own polling code (noise), and
    # notes on a stop that the line below says once.
    filters = [("torch.distributed.elastic.multiprocessing.api", _drop_traceback)]
    filters += [(name, drop_stop_notes) for name in AGENT_LOGS]
    for name, keep in filters:
        logging.getLogger(name).addFilter(keep)
    try:
        with interrupt.held_for_workers():  # no KeyboardInterrupt traceback from the workers
            results = elastic_launch(config, worker)(target, cfg, run, args, log_stem)
    except SignalException as e:
        how = f"stopped on {signal_name(e.sigval)}"
        raise Preempted(e.sigval, stopped_line(how, run.output_dir, run.sweep_dir)) from None
    except KeyboardInterrupt:
        # Ctrl-C before the agent handles signals: it stops its workers on its way out.
        raise Preempted(
            signal.SIGINT, stopped_line("stopped on SIGINT", run.output_dir, run.sweep_dir)
        ) from None
    except ChildFailedError as e:
        status = stop_status(f.exitcode for f in e.failures.values())
        if status is not None:  # the workers themselves were signalled and stopped cleanly
            signum = status - 128
            how = f"the workers stopped on {signal_name(signum)}"
            raise Preempted(signum, stopped_line(how, run.output_dir, run.sweep_dir)) from None
        exit_codes = {rank: f.exitcode for rank, f in e.failures.items()}
        raise worker_failed(exit_codes, errors, Path(run.output_dir), log_stem) from None
    finally:
        for name, keep in filters:
            logging.getLogger(name).removeFilter(keep)
        if saved is None:
            os.environ.pop(_NO_SHARED_STORE, None)
        else:
            os.environ[_NO_SHARED_STORE] = saved
    return results[0]


def stopped_line(how: str, output_dir: Any, sweep_dir: Any = None) -> str:
    """The line for a job stopped by a signal outside the loop: how to resume, if it can."""
    newest = checkpoint.latest(Path(output_dir))
    if newest is None:
        return (
            f"{how}, before any checkpoint was written: nothing to resume, re-running the same "
            "command starts again from step 0"
        )
    return (
        f"{how}: {rerun(output_dir, sweep_dir)} to resume from its newest checkpoint "
        f"({newest.name})"
    )


def _drop_traceback(record: logging.LogRecord) -> bool:
    record.exc_info, record.exc_text = None, None
    return True


def worker(
    target: Callable[..., Any], cfg: TrainConfig, run: Any, args: tuple, log_stem: str
) -> Any:
    interrupt.quiet_while_starting()  # done on import already, unless __main__ skipped it
    rank = int(os.environ.get("RANK", 0))
    _setup_worker_logging(Path(run.output_dir), rank, log_stem)
    claim.join(run.output_dir)
    # A restarted group: what this rank said in the last attempt is over.
    (Path(run.output_dir) / "errors" / f"rank{rank}.txt").unlink(missing_ok=True)
    try:
        return target(cfg, env_from_environ(cfg.dist), run, *args)
    except Preempted as e:
        if not e.logged:
            (log.warning if rank == 0 else log.info)("%s", e)
        interrupt.exit_now(e.exit_code)
    except KeyboardInterrupt:
        # Ctrl-C at start-up, or a second one: the launcher says it, this rank's log only.
        interrupt.ignore_more()
        log.info("stopped on SIGINT", extra={_FILE_ONLY: True})
        interrupt.exit_now(interrupt.EXIT_CODE)
    except Exception as e:
        e = one_line(e, rank, cfg.dist.timeout_s, Path(run.output_dir)) or e
        code = exit_code(e, log)
        write_rank_error(e, rank, Path(run.output_dir) / "errors")
        interrupt.exit_now(code)  # not a traceback from every worker: the log has it


def _setup_worker_logging(output_dir: Path, rank: int, stem: str) -> None:
    console = logging.StreamHandler(sys.stderr)
    # Only rank 0 talks on the console; every rank keeps its full log.
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    console.addFilter(lambda r: not getattr(r, _FILE_ONLY, False))
    file = logging.FileHandler(output_dir / f"{stem}_rank{rank}.log")
    logging.basicConfig(
        level=logging.INFO, format=_LOG_FORMAT, handlers=[console, file], force=True
    )
