"""Errors a user can act on: `UserError`, the one exception type for bad input, and how a
failed job ends (`exit_code`). What else becomes one line lives where it happens
(distributed/failures.py, disk.py, components.py).
"""

from __future__ import annotations

import logging


class Stopped(Exception):
    """Not a failure: the job stopped on request (preemption.Preempted), nothing to blame."""


class UserError(Exception):
    """Bad input: the message names the key or file and says what to do. The entry prints it
    as one line and exits with status 2, instead of a traceback from every rank."""


# The libraries an optional extra of pyproject.toml brings: a feature that needs one names it.
EXTRAS = {"optuna": "sweep", "ray": "ray", "transformers": "transformers"}


def needs_package(what: str, module: str) -> UserError:
    """`what` (a key, a preset) needs `module`, which is not installed: what to pip install."""
    top = module.split(".")[0]
    fix = f'pip install -e ".[{EXTRAS[top]}]"' if top in EXTRAS else f"pip install {top}"
    return UserError(f"{what} needs {top}, which is not installed here: {fix}")


def check_setting(ok: bool, key: str, allowed: str, value: object) -> None:
    """Unless `ok`, a UserError naming the key, its value and what it must be."""
    if not ok:
        raise UserError(f"{key}={value!r} is not allowed: {key} must be {allowed}")


def shorten(text: str, limit: int = 60, quote: bool = False) -> str:
    """A value quoted in an error message: long ones cut, with their length."""
    if len(text) <= limit:
        return repr(text) if quote else text
    head = repr(text[:limit]) if quote else text[:limit]
    return f"{head}... ({len(text)} characters)"


def first_line(e: BaseException, limit: int = 200) -> str:
    """The gist of a library error: its first non-empty line, without a `[file:line]` source
    prefix, cut at the first sentence when long."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    line = lines[0] if lines else type(e).__name__
    if line.startswith("[") and "] " in line:
        line = line.split("] ", 1)[1]
    if len(line) > limit and ". " in line:
        line = line[: line.index(". ") + 1]
    return line if len(line) <= limit else line[: limit - 3] + "..."


def config_error(e: BaseException) -> UserError | None:
    """One line for a config value that OmegaConf cannot resolve: usually `${...}` typed on the
    command line, which OmegaConf reads as an interpolation."""
    from omegaconf.errors import InterpolationResolutionError

    if not isinstance(e, InterpolationResolutionError):
        return None
    key = getattr(e, "full_key", None) or "a value"
    return UserError(
        f"{key}: {first_line(e)}: a value holding ${{...}} is read as an interpolation; to keep "
        "it literally, escape it on the command line as \\${...} (in single quotes: "
        "'key=a\\${IFS}b'), or name a key that exists (${trainer.seed})"
    )


def no_such_key(key: str) -> UserError:
    """A command-line `key=value` whose key the config does not have (a user variable)."""
    return UserError(
        f"{key} is not a key of the config (its top-level keys are the config groups and "
        f"the schema's, src/hydra_ddp/config.py): your own variables go under vars: "
        f"vars.{key}=... (read as ${{vars.{key}}} in the config, cfg.vars in code); to add it "
        f"where it is, +{key}=..."
    )


def exit_code(e: Exception, log: logging.Logger) -> int:
    """Log a failed job's error and return its exit status: 2 and one `error:` line for a
    UserError, 1 and the full traceback for anything else."""
    if isinstance(e, UserError):
        log.error("error: %s", e)
        return 2
    log.error("unexpected error: %s: %s", type(e).__name__, e, exc_info=e)
    return 1


def sweep_under_torchrun() -> UserError:
    return UserError(
        "a sweep (-m) under torchrun would run the whole sweep on every rank: "
        "run `python -m hydra_ddp.train -m dist.nproc_per_node=N ...` instead"
    )


def too_big_for_cluster(
    kind: str, need: float, most: float, job_num: int, nproc: int, where: str
) -> UserError:
    """hydra/launcher=ray: a job of the sweep asks for more CPUs or GPUs than any node of the
    Ray cluster has (Ray would queue it forever)."""
    key = "gpus_per_job" if kind == "GPU" else "cpus_per_job"
    return UserError(
        f"job #{job_num} of the sweep asks for {need:g} {kind}(s) (dist.nproc_per_node={nproc}, "
        f"hydra.launcher.{key}) but no node of {where} has more than {most:g}: lower "
        f"dist.nproc_per_node or hydra.launcher.{key}, or add a node with {need:g} {kind}(s)"
    )


def check(ok: bool, name: str, allowed: str, value: object) -> None:
    """For a component's own argument checks: `check(hidden > 0, "hidden", "> 0", hidden)`
    raises a ValueError that `build` reports under the argument's config key. Here, not in
    components.py, as an exported model's module imports it: loading an export needs no Hydra."""
    if not ok:
        raise ValueError(f"{name}={value!r} is not allowed: {name} must be {allowed}")
