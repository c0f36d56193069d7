"""Launching a training job from the command line: what `hydra_ddp.train.main` hands over to.

`main(job, config_path, config_name)` checks the command line, composes the config with Hydra
(a sweep with `-m`: Basic, Ray, submitit, Optuna) and hands each job to `hydra_entry`, which
runs it where Hydra's launcher puts it (run_job.py: the checks, the job here or on a worker
group it starts, every way a job ends as an exit status). Nothing here imports torch: a sweep's
launching process only composes and hands out jobs, and its start is every sweep's wait.
"""

from __future__ import annotations

import functools
import gc
import importlib
import logging
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig

from hydra_ddp import interrupt
from hydra_ddp.config import TrainConfig, register_configs
from hydra_ddp.distributed.launcher_env import launcher_rank, under_launcher
from hydra_ddp.errors import no_such_key
from hydra_ddp.rundir import claim, sweeps
from hydra_ddp.rundir.paths import override_value, register_resolvers

if TYPE_CHECKING:
    from hydra_ddp.distributed.run_job import Job

# At import, not in `main`: a sweep job of submitit or Ray runs in a process of its own that
# unpickles `hydra_entry` (importing this module) and resolves the config's `${ddp_...}` names
# and schema before `main` could run there.
register_configs()
register_resolvers()


def main(job: Job, config_path: str | None = None, config_name: str = "train") -> None:
    """Run `job` as `python -m hydra_ddp.train [overrides]` does, composing `config_name` from
    `config_path` (None: the engine's conf/, `config_dir()`; an absolute path, `pkg://...`, or a
    path from the working dir); exits with the job's status (0, 1, 2 for bad input, 130...)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # A torchrun worker runs one job (run_job refuses a sweep there), so a Ctrl-C while
        # Hydra composes and writes the run dir can wait a second for the job's start to say
        # the full line (resume advice included) once, from rank 0.
        interrupt.hold()
    find_own_plugins()
    conf = config_dir() if config_path is None else config_path
    if "://" not in conf:
        conf = os.path.abspath(conf)
    _check_run_dir(sys.argv[1:])
    _check_keys(sys.argv[1:], conf)
    job = _importable(job)
    task = functools.partial(hydra_entry, job=job)
    # Hydra names the job (hydra.job.name: train.log) after the task function's module.
    task.__module__ = job.__module__
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


def hydra_entry(dict_cfg: DictConfig, job: Job) -> float:
    """One composed job, where Hydra's launcher runs it (this process, a Ray task, a SLURM
    job): `run_job.run_job`; returns the objective for Hydra sweepers."""
    # Imported here, where a job runs: a sweep's launching process (Ray, submitit) only
    # composes and hands out jobs, so it never imports torch (2-4 s; longer from a cluster's
    # shared file system). A Ctrl-C meanwhile waits until run_job can say its one line.
    with interrupt.held_while_importing():
        from hydra_ddp.distributed.run_job import run_job

        return run_job(dict_cfg, job)


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


def _importable(job: Job) -> Job:
    """`job` by its module's name: under `python -m hydra_ddp.train` it is `__main__.train`,
    which neither Hydra can name the job after nor a worker or sweep job import by name."""
    spec = getattr(sys.modules.get(job.__module__), "__spec__", None)
    if job.__module__ != "__main__" or spec is None:
        return job
    return getattr(importlib.import_module(spec.name), job.__qualname__)


def _check_run_dir(argv: list[str]) -> None:
    """`hydra.run.dir=<path>` on the command line that cannot be created (read-only disk, no
    permission): one line here, instead of the traceback of Hydra's mkdir."""
    given = [a for a in argv if a.startswith("hydra.run.dir=")]
    if not given or "${" in given[-1] or any(a in ("-m", "--multirun") for a in argv):
        return
    path = override_value(given[-1])
    if path is None:
        return  # Hydra reports what it cannot parse
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        sys.stderr.write(
            f"error: hydra.run.dir={path} cannot be created ({e.strerror}): choose a "
            "writable place\n"
        )
        sys.exit(2)


def _unknown_top_level_key(override: str, groups: set[str]) -> str | None:
    """The key of a command-line `key=value` whose first part is no key of the config nor a
    config group (`groups`), else None: Hydra's own error would not say where such a variable
    can go."""
    if override.startswith(("-", "+", "~")) or "=" not in override:
        return None
    key = override.split("=", 1)[0]
    root = key.split("/")[0].split(".")[0].split("@")[0]
    known = {f.name for f in fields(TrainConfig)} | groups | {"hydra"}
    return key if root and root not in known else None


def _check_keys(argv: list[str], conf: str) -> None:
    """`reads_dir=...` (no such key): one line saying where user variables go, before Hydra's
    "Could not override" paragraph. `conf`: the config dir; its groups and the engine's are
    keys too (a thin project's config extends the engine's)."""
    dirs = [Path(d) for d in {conf, config_dir()} if Path(d).is_dir()]
    groups = {p.name for d in dirs for p in d.iterdir() if p.is_dir()}
    for arg in argv:
        key = _unknown_top_level_key(arg, groups)
        if key is not None:
            sys.stderr.write(f"error: {no_such_key(key)}\n")
            sys.exit(2)
