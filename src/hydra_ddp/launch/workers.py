"""`python -m hydra_ddp.train dist.nproc_per_node=N` without torchrun: the job that composed the
config starts N workers with torch's elastic agent and hands each the finished config, so no
worker re-composes or re-resolves `${now:}`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any, Callable

from hydra_ddp import checkpoint
from hydra_ddp.config import TrainConfig
from hydra_ddp.distributed import env_from_environ
from hydra_ddp.distributed.failures import one_line, worker_failed, write_rank_error
from hydra_ddp.distributed.preemption import Preempted, run_dir_override, signal_name
from hydra_ddp.distributed.torchrun import AGENT_LOGS, drop_stop_notes, stop_status
from hydra_ddp.errors import exit_code
from hydra_ddp.launch import interrupt
from hydra_ddp.launcher_env import AGENT_SIGNALS
from hydra_ddp.rundir import claim

log = logging.getLogger(__name__)

_LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
_NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_FILE_ONLY = "hydra_ddp_file_only"  # a worker's log record kept off the console


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
        raise Preempted(e.sigval, stopped_line(how, run.output_dir)) from None
    except KeyboardInterrupt:
        # Ctrl-C before the agent handles signals: it stops its workers on its way out.
        raise Preempted(signal.SIGINT, stopped_line("stopped on SIGINT", run.output_dir)) from None
    except ChildFailedError as e:
        status = stop_status(f.exitcode for f in e.failures.values())
        if status is not None:  # the workers themselves were signalled and stopped cleanly
            signum = status - 128
            how = f"the workers stopped on {signal_name(signum)}"
            raise Preempted(signum, stopped_line(how, run.output_dir)) from None
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


def stopped_line(how: str, output_dir: Any) -> str:
    """The line for a job stopped by a signal outside the loop: how to resume, if it can."""
    newest = checkpoint.latest(Path(output_dir))
    if newest is None:
        return (
            f"{how}, before any checkpoint was written: nothing to resume, re-running the same "
            "command starts again from step 0"
        )
    return (
        f"{how}: re-run the same command with {run_dir_override(output_dir)} to resume "
        f"from its newest checkpoint ({newest.name})"
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
