"""What made a result: `run.json` in every run dir, one entry per run in it (a resume appends).

Each entry: start time, the command line and overrides (secret values blanked, see redact.py),
the git commit, branch and dirty flag of the code's checkout with a patch of its uncommitted
changes to tracked files (`git_diff_<n>.patch` beside it), Python and the versions of torch
(with its CUDA and NCCL builds), hydra-core, omegaconf, wandb and numpy, and every rank's host.
No environment variables: they hold credentials. Written by global rank 0; the same facts go
into the W&B run's config as `provenance` when W&B is on.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import logging
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from hydra_ddp import jsonfile, redact
from hydra_ddp.dist import DistEnv, all_gather_objects

log = logging.getLogger(__name__)

FILE = "run.json"
_PACKAGES = ("hydra-core", "omegaconf", "wandb", "numpy", "hydra-ddp")


def record(output_dir: Path, env: DistEnv, overrides: list[str]) -> dict[str, Any]:
    """Collective (every rank's host): append this run's entry to <output_dir>/run.json on rank
    0 and return it (on rank 0; the others get an empty dict)."""
    hosts = all_gather_objects(socket.gethostname(), env)
    if not env.is_main:
        return {}
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    path = Path(output_dir) / FILE
    found = jsonfile.read(path)
    runs = found.get("runs", []) if isinstance(found, dict) else []
    if path.exists() and not isinstance(found, dict):
        log.warning("%s is not readable JSON: starting it anew (the old file is replaced)", path)
    entry: dict[str, Any] = {
        "start_time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": redact.overrides([sys.executable, *sys.argv]),
        "overrides": redact.overrides(overrides),
        "world_size": env.world_size,
        "hosts": sorted(set(hosts)),
        "python": platform.python_version(),
        "versions": versions(),
        "git": git_state(Path(output_dir), len(runs) + 1),
    }
    runs.append(entry)
    jsonfile.write(path, {"runs": runs})
    return entry


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"torch": torch.__version__}
    found["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        found["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    for name in _PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def git_state(output_dir: Path, n: int) -> dict[str, Any] | None:
    """The checkout holding this code: commit, branch, dirty, and the patch of its uncommitted
    changes to tracked files written next to run.json. None outside a git checkout."""
    where = Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(where), *args], capture_output=True, text=True, timeout=20
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None
    dirty = bool((git("status", "--porcelain", "--untracked-files=no") or "").strip())
    state: dict[str, Any] = {
        "commit": commit.strip(),
        "branch": (git("rev-parse", "--abbrev-ref", "HEAD") or "").strip() or None,
        "dirty": dirty,
        "root": (git("rev-parse", "--show-toplevel") or "").strip() or None,
    }
    if dirty:
        patch = output_dir / f"git_diff_{n}.patch"
        patch.write_text(git("diff", "HEAD") or "")
        state["diff"] = patch.name
    return state
