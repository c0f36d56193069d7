"""The checkpoint files on disk: written atomically by global rank 0, the newest K kept,
each checked whole before it is trusted (`checkpoint_damage`), the newest intact one found
(`latest`), and set aside (never deleted) when a run starts over."""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any

import torch

from hydra_ddp.checkpoint import dcp_files
from hydra_ddp.disk import (
    check_regular,
    file_too_large,
    over_size_limit,
    remove_quietly,
    why_write_failed,
    write_failed,
)
from hydra_ddp.errors import UserError, first_line

log = logging.getLogger(__name__)

# step_<step>.pt files; step_<step>.dcp folders are ddp=fsdp2's sharded checkpoints (dcp.py).
_NAME = re.compile(r"^step_(\d{8})\.(?:pt|dcp)$")
_TMP = re.compile(r"^\.step_\d{8}\.pt\.(\d+)\.tmp$")
# The fix for a checkpoint name held by a FIFO, a socket or a device (not made by this template).
_NOT_A_FILE = "remove it, or move it out of {folder} (the template writes only regular files there)"


def checkpoint_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def save(
    state: dict[str, Any], output_dir: Path, step: int, keep: int, name: str | None = None
) -> Path:
    """Write `state` as checkpoints/step_<step>.pt (or checkpoints/<name>, never rotated):
    temporary file, fsync, rename.

    A process killed mid-write leaves only a *.tmp file behind; the previous checkpoint stays
    the newest complete one, and rename is atomic on POSIX file systems.
    """
    folder = checkpoint_dir(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(folder)
    final = folder / (name or f"step_{step:08d}.pt")
    tmp = folder / f".{final.name}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError
        too_large, failed = over_size_limit(e, tmp), write_failed(e, final, folder)
        remove_quietly(tmp)  # then: a full disk needs the space back (for errors/, the logs)
        if too_large:
            raise UserError(file_too_large(final)) from e
        raise failed from e
    fsync_dir(folder)
    if name is None:
        for old in sorted(c for c in _complete(folder) if c[1].suffix == ".pt")[:-keep]:
            old[1].unlink(missing_ok=True)
    return final


def keep_as_best(output_dir: Path, step: int) -> None:
    """Make step <step>'s checkpoint also checkpoints/best.pt: a hard link where the file
    system has them (no second copy on disk), else a copy. Rank 0 only."""
    folder = checkpoint_dir(output_dir)
    source, tmp = folder / f"step_{step:08d}.pt", folder / f".best.pt.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copy2(source, tmp)
    os.replace(tmp, folder / "best.pt")


def best(output_dir: Path) -> Path | None:
    """The run's best checkpoint: checkpoints/best.pt, or a ddp=fsdp2 run's best.dcp (also
    when a replacement of it was killed half-way: dcp_files.best_dcp_folder); None when it has
    none."""
    folder = checkpoint_dir(output_dir)
    return (
        folder / "best.pt" if (folder / "best.pt").exists() else dcp_files.best_dcp_folder(folder)
    )


def write_error(e: BaseException, folder: Path) -> str:
    """Why a write under `folder` failed, in a few words (disk.why_write_failed)."""
    return why_write_failed(e, folder)


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale_tmp(folder: Path) -> None:
    """Delete temporary files left by writers that were killed mid-write. Only global rank 0
    of the job that holds the run dir (rundir/claim.py) writes here: another pid's file is a
    dead writer's."""
    for p in folder.iterdir():
        m = _TMP.match(p.name)
        if m and int(m.group(1)) != os.getpid():
            p.unlink(missing_ok=True)


def _complete(folder: Path) -> list[tuple[int, Path]]:
    if not folder.is_dir():
        return []
    return [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]


def checkpoint_damage(path: Path) -> str | None:
    """Why a file is not a whole, intact torch.save archive, or None when it is.

    torch.save writes a zip whose members each carry a CRC-32: checking every member finds
    bytes flipped anywhere (a bad disk, a partial copy), not only a missing end record. It
    reads the whole file, so the answer is kept for as long as the file is unchanged: picking
    the newest checkpoint and then loading it check it once."""
    if path.is_dir():
        return dcp_files.dcp_folder_damage(path)
    check_regular(path, "checkpoint", _NOT_A_FILE.format(folder=path.parent))
    try:
        st = path.stat()
    except OSError as e:
        return f"unreadable ({first_line(e, 160)})"
    return _damage(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _damage(path: str, size: int, mtime_ns: int) -> str | None:
    try:
        if not zipfile.is_zipfile(path):
            return "not a complete zip archive (truncated?)"
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
        return None if bad is None else f"member {bad} fails its CRC check (corrupt)"
    except (OSError, zipfile.BadZipFile, EOFError, ValueError) as e:
        return f"unreadable ({first_line(e, 160)})"


def latest(output_dir: Path) -> Path | None:
    """The newest intact checkpoint in the job's output dir, if any. A step file that is
    truncated or corrupt is skipped with a warning, and the one before it is used."""
    for _, path in sorted(_complete(checkpoint_dir(output_dir)), reverse=True):
        why = checkpoint_damage(path)
        if why is None:
            return path
        log.warning("skipping %s: %s; trying the previous checkpoint", path, why)
    return None


def check_folder(output_dir: Path) -> None:
    """Refuse a job whose checkpoints/ cannot be a folder, before it trains for nothing."""
    folder = checkpoint_dir(output_dir)
    if folder.exists() and not folder.is_dir():
        raise UserError(
            f"{folder} exists but is not a directory, so no checkpoint could be "
            "saved: move it away, or choose another hydra.run.dir"
        )


def set_aside_checkpoints(output_dir: Path) -> Path | None:
    """trainer.resume=never in a dir that holds checkpoints: move them to
    checkpoints.before-<n>/ (nothing made earlier is deleted), so the new run's rotation and a
    later resume see only its own. Rank 0, before any checkpoint is written."""
    folder = checkpoint_dir(output_dir)
    if not folder.is_dir() or not any(folder.iterdir()):
        return None
    n = 1
    while (aside := folder.with_name(f"checkpoints.before-{n}")).exists():
        n += 1
    folder.rename(aside)
    log.warning(
        "trainer.resume=never: the checkpoints already in %s were moved to %s", folder, aside
    )
    return aside
