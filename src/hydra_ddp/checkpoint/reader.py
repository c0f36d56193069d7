"""Reading a checkpoint, and saying in one line what is wrong with it.

What `trainer.resume`, eval's and export's `ckpt=` and `trainer.init_from` may name: a DDP
run's `checkpoints/step_<step>.pt` or `best.pt` (one torch.save zip archive); a ddp=fsdp2 run's
`step_<step>.dcp/` or `best.dcp/` (DCP's shards, `extra.pt`, and `manifest.json`, written last,
with every other file's size and CRC-32); a run dir or its checkpoints/ (its newest intact
checkpoint); a folder of `python -m hydra_ddp.export`. A checkpoint is checked whole before it
is trusted, and read with `torch.load(weights_only=True)`, which runs no code.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import warnings
import zipfile
import zlib
from pathlib import Path
from pickle import UnpicklingError
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from hydra_ddp.disk import check_regular
from hydra_ddp.errors import UserError, first_line
from hydra_ddp.export_format import CONFIG, read_state

log = logging.getLogger(__name__)

SUFFIX, MANIFEST, EXTRA = ".dcp", "manifest.json", "extra.pt"
# step_<step>.pt files and step_<step>.dcp folders (whole or not); names starting with "." are
# writes in progress or killed.
STEP = re.compile(r"^step_(\d{8})\.(?:pt|dcp)$")
# What torch.load raises for bytes that are no checkpoint (the unpickler's, zip's, torch's).
_BAD_BYTES = (UnpicklingError, RuntimeError, EOFError, OSError, ValueError, IndexError, KeyError)


# ---- which checkpoint ----


def checkpoint_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def steps(folder: Path) -> list[tuple[int, Path]]:
    """The step checkpoints in `folder` (checkpoints/), oldest first, whole or not."""
    if not Path(folder).is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in Path(folder).iterdir() if (m := STEP.match(p.name)))


def latest(output_dir: Path) -> Path | None:
    """The newest intact checkpoint of a run dir, if any; a damaged one is skipped with a
    warning."""
    for _, path in reversed(steps(checkpoint_dir(output_dir))):
        why = why_not_whole(path)
        if why is None:
            return path
        log.warning("skipping %s: %s; trying the previous checkpoint", path, why)
    return None


def is_sharded(path: Path) -> bool:
    """A ddp=fsdp2 checkpoint folder (whole or not)."""
    return Path(path).name.endswith(SUFFIX) and Path(path).is_dir()


def best(output_dir: Path) -> Path | None:
    """The run's best.pt or best.dcp (also when a replacement of it was killed half-way:
    `left_by_swap`), or None."""
    folder = checkpoint_dir(output_dir)
    if (folder / "best.pt").exists():
        return folder / "best.pt"
    final = folder / f"best{SUFFIX}"
    return final if final.is_dir() else left_by_swap(final)


def left_by_swap(final: Path) -> Path | None:
    """When the folder `final` is missing, the whole one that a replacement of it (checkpointer.py's
    `swap_into_place`) killed between its two renames left: the new .<name>.tmp (whole once
    its manifest is written) before the old .<name>.old. A step's whole .tmp with no .old
    beside it is a save killed before its rename (it never had the name): not one."""
    tmp, old = final.with_name(f".{final.name}.tmp"), final.with_name(f".{final.name}.old")
    if final.exists() or not (old.is_dir() or final.name == f"best{SUFFIX}"):
        return None
    return next((p for p in (tmp, old) if p.is_dir() and why_not_whole(p) is None), None)


def resolve_resume(resume: str, output_dir: Path) -> Path | None:
    """trainer.resume -> the checkpoint to load (None: start fresh). auto with only damaged
    checkpoints is refused: a fresh start would rotate them away."""
    if resume == "never":
        return None
    if resume != "auto":
        given = Path(resume).resolve()
        own = Path(output_dir).resolve() in (given, *given.parents)
        if not own and (newest := latest(output_dir)) is not None:
            # The same command run again (the stop line's advice, a requeue) continues this
            # run: going back to its start would retrain, and rotate the run's own away. The
            # file it started from is not read again (it may be gone by then).
            log.info(
                "trainer.resume=%s starts this run only: %s has checkpoints of its own, "
                "resuming from its newest (%s)",
                resume,
                output_dir,
                newest.name,
            )
            return newest
        return named(resume, "trainer.resume")
    found, damaged = latest(output_dir), [p for _, p in steps(checkpoint_dir(output_dir))]
    if found is None and damaged:
        raise refuse(
            f"trainer.resume=auto: no checkpoint in {checkpoint_dir(output_dir)} is intact "
            f"({damaged[-1].name}: {why_not_whole(damaged[-1])}), and a fresh start would replace "
            "them (trainer.resume=never moves them to checkpoints.before-<n>/)",
            "trainer.resume",
        )
    return found


def pick(run: Path, ckpt: str) -> Path:
    """What eval's and export's `ckpt=` names in `run`: last, best, or a path of its own."""
    found = latest(run) if ckpt == "last" else best(run) if ckpt == "best" else named(ckpt, "ckpt")
    if found is None:
        raise UserError(
            f"run={run} holds no {'best' if ckpt == 'best' else 'intact'} checkpoint "
            "(checkpoints/step_*, best.*): give ckpt=<a checkpoint or run dir>"
        )
    return found


def read_picked(run: Path, ckpt: str) -> tuple[Path, dict[str, Any]]:
    """The checkpoint `ckpt=` picks in `run`, and its state. A run resuming in `run` may rotate
    the newest away between the pick and the read: then last and best are picked again."""
    path = pick(run, ckpt)
    while True:
        try:
            return path, load(path, key="ckpt")
        except UserError:
            newer = pick(run, ckpt) if ckpt in ("last", "best") else path
            if newer == path:
                raise
            path = newer


def model_weights(state: dict[str, Any], weights: str = "ema") -> dict[str, Any]:
    """The model's state dict in a read checkpoint: its EMA average where the run kept one and
    `weights` is "ema" (what the run evaluated), else the trained weights."""
    if weights == "ema" and "ema" in state:
        return {k[len("module.") :]: v for k, v in state["ema"].items() if k != "n_averaged"}
    return state["model"]


def named(value: str, key: str) -> Path:
    """The checkpoint `key=value` names, checked whole: a file, a checkpoint or export folder
    itself, or the newest intact checkpoint of a run dir (or of its checkpoints/ folder)."""
    path = Path(value)
    if path.is_dir() and (path / CONFIG).is_file():  # an export folder: read_config checks it
        return path
    if path.is_dir() and not is_sharded(path):
        found = latest(path.parent if path.name == "checkpoints" else path)
        if found is None:
            raise refuse(f"{key}={value}: the directory holds no complete checkpoint", key)
        return found
    check_whole(path, key, missing=f"{key}={value}: no such file")
    return path


def refuse(what: str, key: str) -> UserError:
    """`what` is wrong with a checkpoint that `key` named: the one line, with what to do."""
    otherwise = {"trainer.resume": "=never", "ckpt": "=last or ckpt=best"}.get(key)
    return UserError(
        f"{what}: point {key} at another checkpoint (<run dir>/checkpoints/step_*, best.*) or a "
        f"run dir, or {f'{key}{otherwise}' if otherwise else f'no {key}'}"
    )


# ---- is it whole ----


def why_not_whole(path: Path) -> str | None:
    """Why a checkpoint is not whole, or None: a file's every zip member must pass its CRC-32
    (bytes flipped anywhere are found, not only a missing end); a folder must hold every file
    of its manifest, with its size and CRC-32. The answer is cached while nothing in it
    changes, so picking the newest checkpoint and then loading it reads it once."""
    path = Path(path)
    try:
        if path.is_dir():
            signature = tuple(sorted((p.name, *_stat(p)) for p in path.iterdir()))
        else:
            fix = f"remove it, or move it out of {path.parent} (the template writes only "
            check_regular(path, "checkpoint", fix + "regular files there)")
            signature = _stat(path)
    except OSError as e:
        return f"unreadable ({first_line(e, 160)})"
    return _why_not_whole(str(path), signature)


def _stat(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=16)
def _why_not_whole(path: str, signature: tuple) -> str | None:
    folder = Path(path)
    try:
        if not folder.is_dir():  # the one place that asks "is this a torch.save archive"
            if not zipfile.is_zipfile(path):
                return (
                    "not a torch.save archive: a text file, another format, or a write cut short?"
                )
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
            return None if bad is None else f"member {bad} fails its CRC check (corrupt)"
        if not (folder / MANIFEST).is_file():
            return f"no {MANIFEST} (its write never completed)"
        files = json.loads((folder / MANIFEST).read_text())["files"]
        for name, (length, crc) in files.items():
            file = folder / name
            check_regular(file, "checkpoint file", f"remove it, or move {folder} away")
            if not file.is_file():
                return f"{name} is missing"
            if file.stat().st_size != length:
                return f"{name} holds {file.stat().st_size} bytes, not {length} (truncated?)"
            if crc32(file) != crc:
                return f"{name} fails its CRC check (corrupt)"
        return None
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as e:
        return f"unreadable ({first_line(e, 160)})"


def crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def check_whole(path: Path, key: str, missing: str = "") -> None:
    """Refuse, in one line naming `key`, a checkpoint that is no regular file or folder, missing
    (`missing` says how), empty, or not whole."""
    if not path.is_dir():
        check_regular(path, "checkpoint", f"point {key} at a checkpoint file")
    if not path.exists():  # picked, then rotated away by a run in its dir (trainer.keep_ckpts)
        raise refuse(missing or f"{path} was removed before it could be read", key)
    if path.is_file() and path.stat().st_size == 0:
        raise refuse(f"{path} is empty (a checkpoint whose write never completed?)", key)
    why = why_not_whole(path)
    if why is not None:
        raise refuse(f"{path} is not a readable checkpoint ({why})", key)


# ---- what it holds ----


def load(path: Path, key: str = "trainer.resume") -> dict[str, Any]:
    """A checkpoint's state: a step file whole; a checkpoint folder's model (and EMA) in the
    step file's layout, assembled by DCP without a process group, and its step; an export
    folder's model and step."""
    path = Path(path)
    if path.is_dir() and (path / CONFIG).is_file():
        return read_state(path)
    if not path.is_dir():
        state = read_archive(path, key)
        if not isinstance(state, dict) or "model" not in state or "step" not in state:
            raise refuse(f"{path} is not a hydra-ddp checkpoint (no model/step entries)", key)
        return state
    tensors = dcp_tensors(path, ("model", "ema"), key)
    extra = read_archive(path / EXTRA, key)
    state = {"step": int(extra["step"])}
    state["model"] = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
    if any(k.startswith("ema.") for k in tensors):
        state["ema"] = {f"module.{k[4:]}": v for k, v in tensors.items() if k.startswith("ema.")}
        state["ema"]["n_averaged"] = torch.tensor(int(extra.get("ema_n_averaged", 1)))
    return state


def read_archive(path: Path, key: str, mmap: bool = False) -> Any:
    """What a torch.save file holds, read with `torch.load(weights_only=True)`."""
    path = Path(path)
    check_whole(path, key)
    try:
        with warnings.catch_warnings():
            # e.g. "Detected pickle protocol 4": noise next to the one-line error below.
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except _BAD_BYTES as e:
        # weights_only names a forbidden global ("unsupported GLOBAL posix.system") when the
        # file asks to import and call code; any other failure means bad bytes.
        lines = str(e).splitlines() if isinstance(e, UnpicklingError) else []
        banned = next((ln.strip() for ln in lines if "GLOBAL" in ln.upper()), None)
        if banned is not None:
            raise UserError(
                f"refusing to load {path}: it holds objects that would run code when unpickled "
                f"({banned}); torch.load(weights_only=True) rejected it. Only load checkpoints "
                "you trust, re-saved as plain tensors"
            ) from e
        raise refuse(f"{path} is not a readable checkpoint ({first_line(e, 160)})", key) from e


def dcp_tensors(path: Path, members: tuple[str, ...], key: str) -> dict[str, torch.Tensor]:
    """The whole tensors of `members` in a checkpoint folder, by DCP key, assembled by DCP
    from every rank's shards with no process group."""
    wanted = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in dcp_index(path, key).items()
        if k.split(".", 1)[0] in members
    }
    try:
        with warnings.catch_warnings():
            # "torch.distributed is ... uninitialized, assuming ... a single process": just so.
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(wanted, checkpoint_id=str(path), no_dist=True)
    except (OSError, RuntimeError, ValueError, dcp.CheckpointException) as e:
        # Whole when checked, gone now: a run in its dir rotated it away (trainer.keep_ckpts).
        why = "removed while it was being read" if not path.exists() else first_line(e, 160)
        raise refuse(f"{path} is not a readable checkpoint ({why})", key) from e
    return wanted


def dcp_index(path: Path, key: str) -> dict[str, Any]:
    """A whole checkpoint folder's tensors (DCP's metadata), by DCP key."""
    check_whole(path, key)
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k: m for k, m in metadata.items() if isinstance(m, dcp.TensorStorageMetadata)}
