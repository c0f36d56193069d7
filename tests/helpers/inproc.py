"""The entry point's pieces, in process: compose the config as `python -m hydra_ddp.train` does
(Hydra's compose API on the same config dir, resolvers and schema), type and preflight it, and
run the training loop on one rank here or on several with helpers/ranks.py.

`train` (hydra_ddp.train) is re-exported here for the tests that run a job, and `prepare_job`
is its start before any process group; tests of a module's
own parts (test_step.py, test_config.py, ...) import that module directly.

`isolated()` puts back what a run changes in the process: environment variables, the working
directory, RNG states, torch's determinism and anomaly flags and thread count, logging handlers
and levels, and the stop-signal handlers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
from hydra import compose as _compose
from hydra import initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from hydra_ddp.config import TrainConfig, register_configs
from hydra_ddp.distributed import DistEnv, env_from_environ
from hydra_ddp.launch.command import config_dir
from hydra_ddp.launch.runner import preflight, to_typed
from hydra_ddp.launcher_env import STOP_SIGNALS, under_launcher
from hydra_ddp.loop import prepare as rank_job
from hydra_ddp.rank_job import RankJob
from hydra_ddp.rundir.paths import register_resolvers
from hydra_ddp.tracking import RunInfo
from hydra_ddp.train import train

__all__ = [
    "compose",
    "config_dir",
    "entry",
    "entry_on_a_rank",
    "isolated",
    "job",
    "preflight",
    "prepare_job",
    "run_info",
    "to_typed",
    "train",
    "train_here",
    "train_rank",
    "typed",
]

register_configs()
register_resolvers()


def compose(
    *overrides: str, return_hydra_config: bool = False, conf: Optional[str] = None
) -> DictConfig:
    """The composed config of `python -m hydra_ddp.train overrides...` (conf: another dir)."""
    with initialize_config_dir(config_dir=conf or config_dir(), version_base="1.3"):
        return _compose("train", overrides=list(overrides), return_hydra_config=return_hydra_config)


def typed(*overrides: str) -> TrainConfig:
    """Composed and typed, with every __post_init__ check: what the entry trains with."""
    return to_typed(compose(*overrides))


def run_info(dict_cfg: DictConfig, output_dir: Path, job_name: str = "train") -> RunInfo:
    """What `hydra_ddp.train.run_info` makes from Hydra's runtime, for a chosen output dir."""
    config = OmegaConf.to_container(dict_cfg, resolve=True, enum_to_str=True)
    return RunInfo(output_dir=Path(output_dir), job_name=job_name, group="tests", config=config)


def job(output_dir: Path, *overrides: str) -> tuple[TrainConfig, RunInfo]:
    """The typed config and run info of a job in `output_dir`."""
    dict_cfg = compose(*overrides)
    return to_typed(dict_cfg), run_info(dict_cfg, output_dir)


def train_here(output_dir: Path, *overrides: str, env: Optional[DistEnv] = None) -> dict[str, Any]:
    """One rank in this process (no process group): the job's summary. On one thread, as a
    rank under torchrun (OMP_NUM_THREADS=1): two threads on a busy 2-core machine are ~10x
    slower."""
    cfg, run = job(output_dir, *overrides)
    with isolated():
        torch.set_num_threads(1)
        return train(cfg, env or DistEnv(), run)


def entry(output_dir: Path, *overrides: str) -> None:
    """What `python -m hydra_ddp.train overrides...` runs (`hydra_ddp.train.hydra_entry`) in
    `output_dir`, in process: compose, type, then `preflight` and the workers' `train` on
    gloo ranks of helpers/ranks.py for a self-launched job (dist.nproc_per_node > 1), else
    `train` here with the launcher's variables read as the entry reads them."""
    dict_cfg = compose(*overrides)
    cfg = to_typed(dict_cfg)
    if cfg.dist.nproc_per_node > 1 and not under_launcher():
        preflight(cfg, cfg.dist.nproc_per_node)
        train_ranks(output_dir, *overrides, world_size=cfg.dist.nproc_per_node)
    else:
        with isolated():
            torch.set_num_threads(1)
            train(cfg, env_from_environ(cfg.dist), run_info(dict_cfg, output_dir))


def entry_on_a_rank(env: DistEnv, output_dir: Path, overrides: list[str]) -> None:
    """`entry` as a function of helpers/ranks.py: in a process of its own, with the launcher
    variables the call sets (a process group that hangs or ends its process is not the test
    process's)."""
    entry(output_dir, *overrides)


def prepare_job(cfg: TrainConfig, env: DistEnv, run: RunInfo) -> RankJob:
    """What `train` builds on a rank before its process group (hydra_ddp.train)."""
    console = rank_job.start_rank(cfg, env)
    return rank_job.prepare(cfg, env, run, console, rank_job.build_data(cfg, env))


def train_rank(env: DistEnv, cfg: TrainConfig, run: RunInfo) -> dict[str, Any]:
    """A rank of helpers/ranks.py running the loop (with group=False: it starts its own)."""
    return train(cfg, env, run)


@contextlib.contextmanager
def isolated() -> Iterator[None]:
    """Run a block, then put back the process state a training run changes."""
    environ = dict(os.environ)
    cwd = os.getcwd()
    path = list(sys.path)
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    flags = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.benchmark,
        torch.is_anomaly_enabled(),
        torch.is_anomaly_check_nan_enabled(),
        torch.get_num_threads(),
    )
    root = logging.getLogger()
    handlers = [(h, h.level) for h in root.handlers]
    level = root.level
    main = threading.current_thread() is threading.main_thread()
    signals = {
        sig: signal.getsignal(sig)
        for name in STOP_SIGNALS
        if main and (sig := getattr(signal, name, None)) is not None
    }
    try:
        yield
    finally:
        for sig, handler in signals.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        for h in root.handlers[:]:
            if all(h is not old for old, _ in handlers):
                root.removeHandler(h)
                h.close()
        for h, lvl in handlers:
            if h not in root.handlers:
                root.addHandler(h)
            h.setLevel(lvl)
        root.setLevel(level)
        det, warn_only, bench, anomaly, check_nan, threads = flags
        torch.use_deterministic_algorithms(det, warn_only=warn_only)
        torch.backends.cudnn.benchmark = bench
        torch.autograd.set_detect_anomaly(anomaly, check_nan)
        torch.set_num_threads(threads)
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])
        sys.path[:] = path
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)


def train_ranks(
    output_dir: Path,
    *overrides: str,
    world_size: int = 2,
    env: Optional[dict[str, Optional[str]]] = None,
    timeout: float = 240.0,
    return_exceptions: bool = False,
) -> Any:
    """`train` on `world_size` gloo ranks of helpers/ranks.py: each rank's summary (or
    exception), with `.logs` and `.outputs` of each rank."""
    from helpers import ranks

    cfg, run = job(output_dir, *overrides)
    return ranks.run(
        train_rank,
        cfg,
        run,
        world_size=world_size,
        group=False,
        env=env,
        timeout=timeout,
        return_exceptions=return_exceptions,
    )
