"""Where a job writes: its run dir, a sweep's job dirs, the per-rank log files, `.hydra.N`; the
`${ddp_...}` resolvers conf/train.yaml uses, resolved in every process that composes.
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
# A job dir name's other characters (`/`, `:`, spaces, quotes, ...) become `_`.
_UNSAFE = re.compile(r"[^A-Za-z0-9._=,+@%-]")
# In the sweep dir: the keys the sweep varies (written by SweepReport at the sweep's start).
SWEPT_KEYS_FILE = "sweep_keys.json"


@functools.cache
def job_dir(default: str) -> str:
    """hydra.run.dir for this process. Under torchrun every rank composes, seconds apart, and
    would resolve `${now:}` to its own time: rank 0's choice is agreed through the agent's store
    (a restarted group gets the first attempt's dir), else the launcher's job id names it."""
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
    # Here: a sweep's launching process composes too, and never imports torch.
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
    """`path`, or `path-2`, `path-3`, ...: created exclusively, so two jobs started in the same
    second never share an output dir."""
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
    """hydra.output_subdir, rank 0 only: a later run in the dir (a resume) writes `.hydra.2`,
    ..., so `.hydra/` stays the record of the first. Cached: Hydra resolves it more than once."""
    if launcher_rank() != 0:
        return None
    n = 1
    while os.path.exists(os.path.join(output_dir, default if n == 1 else f"{default}.{n}")):
        n += 1
    return default if n == 1 else f"{default}.{n}"


def log_file(output_dir: str, stem: str) -> str:
    """The job's log file, one per rank under a launcher. Rank 0 claims the dir first. The first
    write into the dir: one that cannot be written stops here in one line, not in Hydra's
    "Unable to configure handler" traceback."""
    name = f"{stem}_rank{launcher_rank()}" if under_launcher() else stem
    path = os.path.join(output_dir, f"{name}.log")
    try:
        if launcher_rank() == 0:
            os.makedirs(output_dir, exist_ok=True)
            claim.claim(output_dir)
        else:
            claim.wait_for_own_job(output_dir)
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
    """The keys a sweep varies, on the command line and in `hydra.sweeper.params`."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = dict(sweeper_params or {})
    lines = [f"{k}={v}" for k, v in params.items()] + list(task_overrides)
    keys: list[str] = []
    for override in OverridesParser.create().parse_overrides(lines):
        key = override.key_or_group + (f"@{override.package}" if override.package else "")
        if override.is_sweep_override() and key not in keys:
            keys.append(key)
    return keys


def sweep_subdir(
    num: Any, task_overrides: Sequence[str], sweep_dir: str, sweeper_params: Any = None
) -> str:
    """hydra.sweep.subdir: the job number, then `key=value` of each swept key (`0_model=mlp`),
    secrets blanked, unsafe characters as `_`, and a name over SUBDIR_MAX_CHARS cut to end in a
    hash of the whole (two long ones stay apart)."""
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
    """This job's `(key, value)` of each swept key (secrets blanked). The keys: those the report
    wrote at the sweep's start, else Hydra's multirun.yaml, else `hydra.sweeper.params`, else
    every override."""
    pairs = [split_override(line) for line in task_overrides]
    keys = _known_swept_keys(Path(sweep_dir), sweeper_params)
    if keys is not None:
        pairs = [(k, v) for k, v in pairs if k in keys]
    return [(k, redact.REDACTED if v and redact.is_secret(k) else v) for k, v in pairs]


def split_override(line: str) -> tuple[str, str]:
    """`+a.b=1e-3` -> ("a.b", "1e-3"): the key as `swept_keys` spells it and the value as typed."""
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
    for name, fn in [
        ("ddp_job_dir", job_dir),
        ("ddp_hydra_subdir", hydra_subdir),
        ("ddp_log_file", log_file),
        ("ddp_sweep_subdir", sweep_subdir),
    ]:
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn, use_cache=True)
