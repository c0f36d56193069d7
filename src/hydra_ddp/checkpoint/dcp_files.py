"""Reading a sharded checkpoint folder (ddp=fsdp2) without a process group: is it one, is it
whole (its manifest's sizes and CRC-32s), and its full model and EMA as plain tensors. Apart
from dcp.py, which writes the folders, so that files.py and reading.py can read them without
importing the writer (which builds on checkpointer.py)."""

from __future__ import annotations

import functools
import json
import re
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from hydra_ddp.disk import check_regular
from hydra_ddp.errors import UserError, first_line

SUFFIX = ".dcp"
NAME = re.compile(r"^step_(\d{8})\.dcp$")
MANIFEST, EXTRA = "manifest.json", "extra.pt"


def is_checkpoint(path: Path) -> bool:
    """A DCP checkpoint folder (complete or not)."""
    return Path(path).name.endswith(SUFFIX) and Path(path).is_dir()


def best_dcp_folder(folder: Path) -> Path | None:
    """checkpoints/best.dcp, or what a replacement of it killed half-way left (see
    `left_by_swap`); None when the run has no best checkpoint."""
    final = Path(folder) / f"best{SUFFIX}"
    return final if final.is_dir() else left_by_swap(final)


def left_by_swap(final: Path) -> Path | None:
    """When `final` is missing, the whole folder that a replacement of it (dcp.py's
    `_swap_into_place`) killed between its two renames left: the new one (.<name>.tmp, whole
    once its manifest is written) before the old one (.<name>.old). A step's whole .tmp with
    no .old beside it is a save killed before its rename (it never had the name): not one."""
    tmp, old = final.with_name(f".{final.name}.tmp"), final.with_name(f".{final.name}.old")
    if final.exists() or not (old.is_dir() or final.name == f"best{SUFFIX}"):
        return None
    return next((p for p in (tmp, old) if p.is_dir() and dcp_folder_damage(p) is None), None)


def dcp_folder_damage(path: Path) -> str | None:
    """Why a checkpoint folder is not whole, or None when every file its manifest lists is
    there with its size and CRC-32. Cached while no file in it changes (picking the newest
    checkpoint and then loading it read the files once)."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        return "no manifest.json (its write never completed)"
    try:
        stats = tuple(
            sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir())
        )
    except OSError as e:
        return f"unreadable ({first_line(e, 160)})"
    return _damage(str(path), stats)


@functools.lru_cache(maxsize=16)
def _damage(path: str, stats: tuple) -> str | None:
    try:
        files = json.loads((Path(path) / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"manifest.json unreadable ({first_line(e, 120)})"
    for name, (length, crc) in files.items():
        file = Path(path) / name
        check_regular(file, "checkpoint file", f"remove it, or move {path} away")
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != length:
            return f"{name} holds {file.stat().st_size} bytes, not {length} (truncated?)"
        if _crc(file) != crc:
            return f"{name} fails its CRC check (corrupt)"
    return None


def _crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def load_full(path: Path) -> dict[str, Any]:
    """The whole model (and EMA) of a checkpoint folder as plain CPU tensors, with its step,
    in the single-file checkpoint's layout ({"model": ..., "ema": ..., "step": ...}). Needs no
    process group: DCP assembles every tensor from all ranks' shards."""
    path = Path(path)
    why = dcp_folder_damage(path)
    if why is not None:
        raise UserError(
            f"{path} is not a readable checkpoint ({why}): use another one of the run's "
            "checkpoints/step_*.dcp"
        )
    reader = dcp.FileSystemReader(str(path))
    wanted: dict[str, torch.Tensor] = {}
    for key, meta in reader.read_metadata().state_dict_metadata.items():
        if key.split(".", 1)[0] in ("model", "ema") and isinstance(meta, dcp.TensorStorageMetadata):
            wanted[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with warnings.catch_warnings():
        # "torch.distributed is ... uninitialized, assuming ... a single process": just so.
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(wanted, storage_reader=reader, no_dist=True)
    extra = _read_extra(path)
    state: dict[str, Any] = {"step": int(extra["step"])}
    state["model"] = {k[len("model.") :]: v for k, v in wanted.items() if k.startswith("model.")}
    if any(k.startswith("ema.") for k in wanted):
        state["ema"] = {f"module.{k[4:]}": v for k, v in wanted.items() if k.startswith("ema.")}
        state["ema"]["n_averaged"] = torch.tensor(int(extra.get("ema_n_averaged", 1)))
    return state


def _read_extra(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path / EXTRA, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(
            f"{path / EXTRA} is not readable ({first_line(e, 160)}): use another checkpoint"
        ) from e
