"""What made a result: `run.json`, one entry per run in the dir (a resume appends): start time,
command and overrides (secrets blanked), the checkout's git state with a patch of its changes,
versions, every rank's host. No environment variables: they hold credentials.
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

from hydra_ddp import redact
from hydra_ddp.distributed import DistEnv, all_gather_objects
from hydra_ddp.rundir import jsonfile

log = logging.getLogger(__name__)

FILE = "run.json"
# run.json lists at most this many untracked files (and says how many more there are).
UNTRACKED_LISTED = 200
# trainer.untracked_content: untracked files larger than this are listed, not copied.
UNTRACKED_MAX_BYTES = 1 << 20
_PACKAGES = ("hydra-core", "omegaconf", "wandb", "numpy", "hydra-ddp")


def record_run(
    output_dir: Path, env: DistEnv, overrides: list[str], untracked_content: bool = False
) -> dict[str, Any]:
    """Collective (every rank's host): append this run's entry to run.json on rank 0 and return
    it there ({} on the others)."""
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
        "git": git_state(Path(output_dir), len(runs) + 1, untracked_content),
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


def git_state(
    output_dir: Path, n: int, untracked_content: bool = False, checkout: Path | None = None
) -> dict[str, Any] | None:
    """The checkout of this code (or `checkout`): commit, branch, dirty, its untracked files not
    ignored (a new model file is part of what made the result), and a patch of its changes
    beside run.json (`untracked_content`: with the untracked files up to UNTRACKED_MAX_BYTES).
    None outside a git checkout."""
    where = Path(checkout) if checkout is not None else Path(__file__).resolve().parent

    def git(*args: str, ok: tuple[int, ...] = (0,)) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(where), *args],
                capture_output=True,
                text=True,
                errors="replace",  # a file that is not UTF-8 must not stop the run
                timeout=20,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode in ok else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None
    root = (git("rev-parse", "--show-toplevel") or "").strip() or None
    # Its untracked, not ignored files, but this run's own output dir's.
    listed = git("-C", root, "ls-files", "--others", "--exclude-standard", "-z") if root else ""
    own, untracked = Path(output_dir).resolve(), []
    for name in sorted(filter(None, (listed or "").split("\0"))):
        path = Path(root or ".") / name
        try:
            if not path.resolve().is_relative_to(own):
                untracked.append({"path": name, "bytes": path.stat().st_size})
        except OSError:  # gone since git listed it
            pass
    changed = bool((git("status", "--porcelain", "--untracked-files=no") or "").strip())
    state: dict[str, Any] = {
        "commit": commit.strip(),
        "branch": (git("rev-parse", "--abbrev-ref", "HEAD") or "").strip() or None,
        "dirty": changed or bool(untracked),
        "root": root,
        "untracked": untracked[:UNTRACKED_LISTED],
    }
    if len(untracked) > UNTRACKED_LISTED:
        state["untracked_not_listed"] = len(untracked) - UNTRACKED_LISTED
    patch = (git("diff", "HEAD") or "") if changed else ""
    if untracked_content and root is not None:
        for entry in untracked:
            if entry["bytes"] <= UNTRACKED_MAX_BYTES:
                # --no-index exits 1 when the files differ, as they always do here.
                new = ("diff", "--no-index", "--binary", "--", "/dev/null", entry["path"])
                patch += git("-C", root, *new, ok=(0, 1)) or ""
    if patch:
        (output_dir / f"git_diff_{n}.patch").write_text(patch)
        state["diff"] = f"git_diff_{n}.patch"
    if untracked:
        log.info(
            "run.json: %d untracked file(s) in the checkout (%s%s)%s",
            len(untracked),
            ", ".join(e["path"] for e in untracked[:5]),
            ", ..." if len(untracked) > 5 else "",
            "" if untracked_content else "; trainer.untracked_content=true saves their contents",
        )
    return state
