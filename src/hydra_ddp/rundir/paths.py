"""Where a job writes: its run dir, a sweep's job dirs, the per-rank log files, `.hydra.N`.

All of it is resolved by Hydra while it composes the config (the resolvers registered below,
used in conf/train.yaml), in every process that composes: each torchrun rank, each submitit
task. One module, so the naming rules are read in one place.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import os
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from omegaconf import OmegaConf

from hydra_ddp import redact
from hydra_ddp.disk import open_regular, write_advice
from hydra_ddp.errors import UserError
from hydra_ddp.launcher_env import launcher_rank, under_launcher
from hydra_ddp.rundir import claim, jsonfile

# At most this many characters in a job dir's name; longer ones end in a hash of the full name.
SUBDIR_MAX_CHARS = 80
# What a job dir's name keeps as it is; any other character (`/`, `:`, spaces, quotes, ...)
# becomes `_`.
_UNSAFE = re.compile(r"[^A-Za-z0-9._=,+@%-]")
# In the sweep dir: the keys the sweep varies (written by SweepReport at the sweep's start).
SWEPT_KEYS_FILE = "sweep_keys.json"


@functools.cache
def job_dir(default: str) -> str:
    """hydra.run.dir for this process.

    With `@hydra.main` under torchrun every rank composes its own config, seconds apart on
    several nodes, so each would resolve `${now:}` to its own timestamp. Here rank 0's choice is
    agreed through the store torchrun's agent already runs for the job (compare_set, so a
    restarted worker group gets the directory of the first attempt and can resume from it).
    Without an agent store the launcher's job id names the directory. A timestamped dir is
    claimed by creating it (`claim_dir`), so jobs started in the same second get their own.
    """
    if "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return _agree_through_store(default)
        return os.path.join("outputs", "torchrun", os.environ["TORCHELASTIC_RUN_ID"])
    if int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ:
        return os.path.join(
            "outputs", "slurm", f"{os.environ['SLURM_JOB_ID']}_{os.environ.get('SLURM_STEP_ID', 0)}"
        )
    return claim_dir(default)


def _agree_through_store(default: str) -> str:
    # Here, in a torchrun rank, not at the top: a sweep's launching process composes too and
    # runs no job, so it never imports torch.
    import torch.distributed as dist

    key = f"hydra_ddp/job_dir/{os.environ['TORCHELASTIC_RUN_ID']}"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=300),
    )
    if launcher_rank() == 0:
        if store.check([key]):  # a restarted worker group: the first attempt's dir
            return store.get(key).decode()
        # compare_set writes only if the key is absent and returns what the key holds.
        return store.compare_set(key, "", claim_dir(default)).decode()
    return store.get(key).decode()


def claim_dir(path: str) -> str:
    """`path`, or `path-2`, `path-3`, ... if it exists: created here, exclusively, so two jobs
    started in the same second (same `${now:}` timestamp) never share an output dir."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    for n in range(1, 10_000):
        candidate = path if n == 1 else f"{path}-{n}"
        try:
            os.mkdir(candidate)
            return candidate
        except FileExistsError:
            continue
    raise UserError(f"could not create a new output dir next to {path}: 10,000 exist")


@functools.cache
def hydra_subdir(default: str, output_dir: str) -> str | None:
    """hydra.output_subdir: only global rank 0 writes the .hydra/ dump.

    A later run in a dir that already has one (a resume, a re-run, a refused resume) writes
    `.hydra.2`, `.hydra.3`, ... instead: `.hydra/` stays the record of the config the dir's
    first run, and its checkpoints, were made with. Cached: Hydra resolves this more than once
    per job, and the second time `.hydra/` exists."""
    if launcher_rank() != 0:
        return None
    n = 1
    while os.path.exists(os.path.join(output_dir, default if n == 1 else f"{default}.{n}")):
        n += 1
    return default if n == 1 else f"{default}.{n}"


def log_file(output_dir: str, stem: str) -> str:
    """The job's log file: one per rank whenever a launcher started several ranks.

    Global rank 0 first claims the dir (claim.py). Opening the log is the first write into it
    (Hydra sets up logging before anything else), so a dir that cannot be written to
    (read-only, full, no permission) stops the job here with one line rather than with
    Hydra's "Unable to configure handler" traceback."""
    name = f"{stem}_rank{launcher_rank()}" if under_launcher() else stem
    path = os.path.join(output_dir, f"{name}.log")
    try:
        if launcher_rank() == 0:
            os.makedirs(output_dir, exist_ok=True)
            claim.claim(output_dir)  # one job per run dir: before anything is written there
        else:
            claim.wait_for_own_job(output_dir)  # not into another job's dir, nor its logs
        with open_regular(Path(path), "a", what="log file", fix="remove it, or move it away"):
            pass
    except UserError as e:  # a FIFO: the log handler would wait for a reader for ever
        sys.stderr.write(f"error: {e}\n")
        raise SystemExit(2) from None
    except OSError as e:
        sys.stderr.write(
            f"error: cannot write to the output dir {output_dir} ({e.strerror}): "
            f"{write_advice(e.errno)}\n"
        )
        raise SystemExit(2) from None
    return path


def swept_keys(task_overrides: Sequence[str], sweeper_params: Any = None) -> list[str]:
    """The keys a sweep varies: each command-line override that is a sweep (`model=mlp,cnn`,
    `optim.lr=interval(...)`), and each entry of `hydra.sweeper.params` that is one."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = dict(sweeper_params or {})
    lines = [f"{k}={v}" for k, v in params.items()] + list(task_overrides)
    keys: list[str] = []
    for override in OverridesParser.create().parse_overrides(lines):
        key = _key(override)
        if override.is_sweep_override() and key not in keys:
            keys.append(key)
    return keys


def sweep_subdir(
    num: Any, task_overrides: Sequence[str], sweep_dir: str, sweeper_params: Any = None
) -> str:
    """hydra.sweep.subdir: the job number, then `key=value` for each swept key (`0_model=mlp`).

    The keys swept are those SweepReport wrote to <sweep dir>/sweep_keys.json at the start of
    the sweep, else what Hydra's basic sweeper saved in <sweep dir>/multirun.yaml, else the
    job's `hydra.sweeper.params`; when none of those tell, every override of the job counts.
    A secret key's value (redact.py) is left out (`0_db.password=_redacted_`). Characters
    unsafe in a file name become `_`, so a value never nests dirs, and a name over
    SUBDIR_MAX_CHARS is cut and ends in a hash of the whole, so no name is too long for the
    file system and two long ones stay apart. Resolved in the job's own process (also under
    submitit), from its own overrides."""
    pairs = swept_overrides(task_overrides, sweep_dir, sweeper_params)
    full = "_".join([str(num), *([",".join(f"{k}={v}" for k, v in pairs)] if pairs else [])])
    name = _UNSAFE.sub("_", full)
    if len(name) > SUBDIR_MAX_CHARS:
        digest = hashlib.sha256(full.encode()).hexdigest()[:8]
        name = f"{name[: SUBDIR_MAX_CHARS - len(digest) - 1]}-{digest}"
    return name


def swept_overrides(
    task_overrides: Sequence[str], sweep_dir: str, sweeper_params: Any = None
) -> list[tuple[str, str]]:
    """This job's `(key, value)` for each key its sweep varies, as `sweep_subdir` finds them.
    A secret's value (redact.py's rule) would be in every log line, path and W&B run that
    names the dir: it is blanked, and the job number tells such jobs apart instead."""
    pairs = [split_override(line) for line in task_overrides]
    keys = _known_swept_keys(Path(sweep_dir), sweeper_params)
    if keys is not None:
        pairs = [(k, v) for k, v in pairs if k in keys]
    return [(k, redact.REDACTED if v and redact.is_secret(k) else v) for k, v in pairs]


def override_value(line: str) -> str | None:
    """The value of a `key=value` override as Hydra reads it: `hydra.run.dir='out/a b'` is
    `out/a b`, not a path starting with a quote (made by hand, that left a stray `'out/`
    tree). None when Hydra's grammar does not parse it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        value = OverridesParser.create().parse_overrides([line])[0].value()
    except Exception:  # Hydra's own error, said when it composes
        return None
    return value if isinstance(value, str) else str(value)


def _key(override: Any) -> str:
    """An override's key without its `+`/`++`/`~` prefix, with its `@package` if any."""
    key = override.key_or_group
    return f"{key}@{override.package}" if override.package else key


def split_override(line: str) -> tuple[str, str]:
    """`+a.b=1e-3` -> ("a.b", "1e-3"): the key as `_key` spells it and the value as typed."""
    key, _, value = str(line).partition("=")
    return key.lstrip("+~"), value


def _known_swept_keys(sweep_dir: Path, sweeper_params: Any) -> list[str] | None:
    recorded = jsonfile.read(sweep_dir / SWEPT_KEYS_FILE)
    if isinstance(recorded, list):
        return [str(k) for k in recorded]
    try:
        saved = OmegaConf.load(sweep_dir / "multirun.yaml")
        return swept_keys(
            OmegaConf.select(saved, "hydra.overrides.task", default=[]),
            OmegaConf.select(saved, "hydra.sweeper.params", default=None),
        )
    except Exception:  # no such file, or one we cannot read: try the next source
        pass
    keys = swept_keys([], sweeper_params)
    return keys or None


def register_resolvers() -> None:
    """The `ddp_*` resolvers conf/train.yaml names in `hydra.run.dir`, `hydra.sweep.subdir`,
    `hydra.output_subdir` and the log file handler."""
    for name, fn in [
        ("ddp_job_dir", job_dir),
        ("ddp_hydra_subdir", hydra_subdir),
        ("ddp_log_file", log_file),
        ("ddp_sweep_subdir", sweep_subdir),
    ]:
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn, use_cache=True)
