"""Launching a training job from the command line: what `hydra_ddp.train.main` hands over to.

`run_command(train_fn, config_path, config_name)` checks the command line, composes the
config with Hydra (a sweep with `-m`: Basic, Ray, submitit, Optuna) and hands each job to
`hydra_entry`, which runs it where Hydra's launcher puts it (runner.py: the checks, the job
here or on a worker group it starts, every way a job ends as an exit status). Nothing here
imports torch: a sweep's launching process only composes and hands out jobs, and its start is
every sweep's wait.
"""

from __future__ import annotations

import functools
import gc
import importlib
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig

from hydra_ddp.config import register_configs
from hydra_ddp.launch import interrupt, overrides
from hydra_ddp.launcher_env import launcher_rank, torchrun_worker, under_launcher
from hydra_ddp.rundir import claim, sweeps
from hydra_ddp.rundir.paths import register_resolvers

if TYPE_CHECKING:
    from hydra_ddp.launch.runner import TrainFn

# At import, not in `run_command`: a sweep job of submitit or Ray runs in a process of its own that
# unpickles `hydra_entry` (importing this module) and resolves the config's `${ddp_...}` names
# and schema before `main` could run there.
register_configs()
register_resolvers()


def run_command(
    train_fn: TrainFn, config_path: str | None = None, config_name: str = "train"
) -> None:
    """Run `train_fn` as `python -m hydra_ddp.train [overrides]` does, composing `config_name` from
    `config_path` (None: the engine's conf/, `config_dir()`; an absolute path, `pkg://...`, or a
    path from the working dir); exits with the job's status (0, 1, 2 for bad input, 130...)."""
    if torchrun_worker():
        # A torchrun worker runs one job (runner.py refuses a sweep there), so a Ctrl-C while
        # Hydra composes and writes the run dir can wait a second for the job's start to say
        # the full line (resume advice included) once, from rank 0.
        interrupt.hold()
    find_own_plugins()
    conf = config_dir() if config_path is None else config_path
    if "://" not in conf:
        conf = os.path.abspath(conf)
    # The project's config dir and the engine's (a thin project's config extends it), and any
    # a --config-path or --config-dir on the command line adds; a `pkg://` one cannot be
    # listed, so its groups' choices are left to Hydra.
    given = overrides.config_dirs_given(sys.argv[1:])
    dirs = [Path(d) for d in dict.fromkeys([conf, config_dir(), *given])]
    overrides.check_command_line(
        sys.argv[1:], [d for d in dirs if d.is_dir()], all(d.is_dir() for d in dirs)
    )
    train_fn = _importable(train_fn)
    task = functools.partial(hydra_entry, train_fn=train_fn)
    # Hydra names the job (hydra.job.name: train.log) after the task function's module.
    task.__module__ = train_fn.__module__
    try:
        hydra.main(version_base="1.3", config_path=conf, config_name=config_name)(task)()
        code = 1 if sweeps.sweep_failed() else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        sweeps.report_stopped()  # a sweep whose job in this process stopped on a signal
    except KeyboardInterrupt:
        # Outside hydra_entry: while Hydra composes the config (not a torchrun worker's: held),
        # or a sweep's launching process (its jobs are stopped by their own launcher).
        interrupt.ignore_more()
        if launcher_rank() == 0:
            sys.stderr.write("stopped on SIGINT\n")
        code = interrupt.EXIT_CODE
    claim.release_all()
    claim.release_sweep()  # a sweep that ended before its report (on_multirun_end)
    if under_launcher():
        # Everything is written and the process group is gone, but at interpreter teardown a
        # rank can still abort ("terminate called without an active exception": a c10d/gloo
        # thread destroyed while joinable), turning a finished job into a failed one for
        # torchrun. Leave without running C++ static destructors.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    # Everything is written and closed. The interpreter's last garbage collections walk every
    # object torch and the job made (about a second, on every command's exit); frozen objects
    # are skipped, while atexit handlers and module teardown still run.
    gc.freeze()
    sys.exit(code)


def hydra_entry(dict_cfg: DictConfig, train_fn: TrainFn) -> float:
    """One composed job, where Hydra's launcher runs it (this process, a Ray task, a SLURM
    job): `runner.run_composed`; returns the objective for Hydra sweepers."""
    # Imported here, where a job runs: a sweep's launching process (Ray, submitit) only
    # composes and hands out jobs, so it never imports torch (2-4 s; longer from a cluster's
    # shared file system). A Ctrl-C meanwhile waits until the runner can say its one line.
    with interrupt.held_while_importing():
        from hydra_ddp.launch.runner import run_composed

        return run_composed(dict_cfg, train_fn)


def config_dir() -> str:
    """The configs: conf/ at the top of a checkout (an editable install, or src/ on PYTHONPATH),
    so an edit there counts at the next run; else the copy a wheel ships as hydra_ddp/conf
    (pyproject.toml's package-dir), so an installed `hydra-ddp-train` runs from any folder."""
    package = Path(__file__).resolve().parent.parent
    checkout = package.parent.parent / "conf"
    if package.parent.name == "src" and (checkout / "train.yaml").is_file():
        return str(checkout)
    return str(package / "conf")


def find_own_plugins() -> None:
    """Let Hydra's plugin scan see src/hydra_plugins (hydra/launcher=ray) of a checkout: an
    editable install (`pip install -e .`) imports it through setuptools' finder, which the
    scan (pkgutil) cannot list, so the launcher would be unknown. A wheel puts it in
    site-packages, where the scan finds it anyway."""
    src = Path(__file__).resolve().parent.parent.parent
    if (src / "hydra_plugins").is_dir() and str(src) not in sys.path:
        sys.path.append(str(src))


def _importable(train_fn: TrainFn) -> TrainFn:
    """`train_fn` by its module's name: under `python -m hydra_ddp.train` it is `__main__.train`,
    which neither Hydra can name the job after nor a worker or sweep job import by name."""
    spec = getattr(sys.modules.get(train_fn.__module__), "__spec__", None)
    if train_fn.__module__ != "__main__" or spec is None:
        return train_fn
    return getattr(importlib.import_module(spec.name), train_fn.__qualname__)
