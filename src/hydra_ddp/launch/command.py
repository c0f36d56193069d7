"""The command line: `run_command` checks it, composes the config with Hydra (a sweep with
`-m`) and hands each job to `hydra_entry`, where Hydra's launcher runs it (runner.py). No torch
here: a sweep's launching process only composes and hands out jobs.
"""

from __future__ import annotations

import functools
import gc
import importlib
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
    from hydra_ddp.config import TrainConfig
    from hydra_ddp.launch.runner import TrainFn

# At import: a submitit or Ray job's process unpickles `hydra_entry` (importing this module) and
# resolves the config's `${ddp_...}` names and schema without `run_command`.
register_configs()
register_resolvers()


def run_command(
    train_fn: TrainFn, config_path: str | None = None, config_name: str = "train"
) -> None:
    """Run `train_fn` as `python -m hydra_ddp.train [overrides]` does, composing `config_name` from
    `config_path` (None: `config_dir()`); exits with the job's status (2 for bad input)."""
    if torchrun_worker():
        # A Ctrl-C while Hydra composes waits for the job's start to say its line, from rank 0.
        interrupt.hold()
    find_own_plugins()
    conf = config_dir() if config_path is None else config_path
    if "://" not in conf:
        conf = os.path.abspath(conf)
    # The project's config dir, the engine's (a thin project extends it), and any the command
    # line adds; a `pkg://` one cannot be listed, so its groups' choices are left to Hydra.
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
    except KeyboardInterrupt:  # while Hydra composes, or in a sweep's launching process
        interrupt.ignore_more()
        if launcher_rank() == 0:
            sys.stderr.write("stopped on SIGINT\n")
        code = interrupt.EXIT_CODE
    claim.release_all()
    claim.release_sweep()  # a sweep that ended before its report (on_multirun_end)
    if under_launcher():
        # At teardown a rank can still abort ("terminate called without an active exception":
        # a gloo thread destroyed while joinable), failing a finished job.
        interrupt.exit_now(code)
    # The last garbage collections would walk every object torch and the job made; frozen
    # objects are skipped, while atexit handlers and module teardown still run.
    gc.freeze()
    sys.exit(code)


def hydra_entry(dict_cfg: DictConfig, train_fn: TrainFn) -> float:
    """One composed job, where Hydra's launcher runs it; the objective for sweepers."""
    # Imported where a job runs (torch with it); a Ctrl-C meanwhile waits for the runner's line.
    with interrupt.held_while_importing():
        from hydra_ddp.launch.runner import run_composed

        return run_composed(dict_cfg, train_fn)


def compose_typed(
    config_path: str | Path | None, config_name: str, overrides: list[str]
) -> TrainConfig:
    """The config `python -m hydra_ddp.train overrides...` trains with, typed and checked,
    composed in this process (for the API, the memory plan and the check)."""
    from hydra import compose, initialize_config_dir

    from hydra_ddp.launch.runner import to_typed

    conf = str(Path(config_path).resolve()) if config_path is not None else config_dir()
    find_own_plugins()  # before Hydra's one plugin scan per process: hydra/launcher=ray, ...
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        return to_typed(compose(config_name, overrides=overrides))


def config_dir() -> str:
    """The configs: conf/ of a checkout (an editable install), else the copy a wheel ships."""
    package = Path(__file__).resolve().parent.parent
    checkout = package.parent.parent / "conf"
    if package.parent.name == "src" and (checkout / "train.yaml").is_file():
        return str(checkout)
    return str(package / "conf")


def find_own_plugins() -> None:
    """Let Hydra's plugin scan (pkgutil) see a checkout's src/hydra_plugins, which an editable
    install imports through setuptools' finder, which the scan cannot list."""
    src = Path(__file__).resolve().parent.parent.parent
    if (src / "hydra_plugins").is_dir() and str(src) not in sys.path:
        sys.path.append(str(src))


def _importable(train_fn: TrainFn) -> TrainFn:
    """`train_fn` by its module's name, not `__main__`'s: a worker imports it by name."""
    spec = getattr(sys.modules.get(train_fn.__module__), "__spec__", None)
    if train_fn.__module__ != "__main__" or spec is None:
        return train_fn
    return getattr(importlib.import_module(spec.name), train_fn.__qualname__)
