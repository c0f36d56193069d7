"""Reading a checkpoint or weights file, and saying in one line what is wrong with it.

What `trainer.resume`, eval's and export's `ckpt=`, and `trainer.init_from` may name:

- a checkpoint of this template: `checkpoints/step_<step>.pt` or `best.pt` (a DDP run's: one
  torch.save zip archive), or `step_<step>.dcp/` or `best.dcp/` (ddp=fsdp2's: DCP's shards,
  `extra.pt`, and `manifest.json`, written last, with every other file's size and CRC-32);
- a run dir, or its checkpoints/ folder: its newest intact checkpoint (`latest`);
- a folder of `python -m hydra_ddp.export` (config.json with a `hydra_ddp` entry);

and, as `trainer.init_from` only (`open_weights`), weights as people have them: a Hugging Face
`save_pretrained` folder (`model.safetensors`, a sharded `model.safetensors.index.json`, or
`pytorch_model.bin`), a `.safetensors` file or index, a `torch.save` file holding a state dict
(bare, or under `model` or `state_dict`, e.g. Lightning's).

A checkpoint is checked whole before it is trusted (`why_not_whole`), and read with
`torch.load(weights_only=True)`, which runs no code; weights are opened without reading them
(`Weights`). Every refusal is one UserError line naming the file, the setting that named it,
and what to do.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import warnings
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from pickle import UnpicklingError
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open

from hydra_ddp.disk import check_regular
from hydra_ddp.errors import UserError, first_line
from hydra_ddp.export_format import CONFIG, MARK, WEIGHTS, read_config, read_state

log = logging.getLogger(__name__)

INIT_FROM = "trainer.init_from"
SUFFIX, MANIFEST, EXTRA = ".dcp", "manifest.json", "extra.pt"
# step_<step>.pt files and step_<step>.dcp folders (whole or not); names starting with "." are
# writes in progress or killed (checkpointer.py, dcp.py).
STEP = re.compile(r"^step_(\d{8})\.(?:pt|dcp)$")
INDEX = "model.safetensors.index.json"
# What save_pretrained writes, in the order from_pretrained prefers them.
HF_FILES = (WEIGHTS, INDEX, "pytorch_model.bin")
# What torch.load raises for bytes that are no checkpoint (the unpickler's, zip's, torch's).
_BAD_BYTES = (UnpicklingError, RuntimeError, EOFError, OSError, ValueError, IndexError, KeyError)
# The fix for a checkpoint name held by a FIFO, a socket or a device (not made by this template).
_NOT_A_FILE = "remove it, or move it out of {folder} (the template writes only regular files there)"


# ---- which checkpoint ----


def checkpoint_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def steps(folder: Path) -> list[tuple[int, Path]]:
    """The step checkpoints in `folder` (checkpoints/), oldest first, whole or not."""
    if not Path(folder).is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in Path(folder).iterdir() if (m := STEP.match(p.name)))


def latest(output_dir: Path) -> Path | None:
    """The newest intact checkpoint of a run dir, if any. One that is truncated or corrupt is
    skipped with a warning, and the one before it is used."""
    for _, path in reversed(steps(checkpoint_dir(output_dir))):
        why = why_not_whole(path)
        if why is None:
            return path
        log.warning("skipping %s: %s; trying the previous checkpoint", path, why)
    return None


def is_sharded(path: Path) -> bool:
    """A ddp=fsdp2 checkpoint folder (whole or not)."""
    return Path(path).name.endswith(SUFFIX) and Path(path).is_dir()


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
    if not is_sharded(path):
        check_regular(path, "checkpoint", f"point {key} at a checkpoint file")
    if not path.exists():
        raise refuse(f"{key}={value}: no such file", key)
    check_whole(path, key)
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
    """Why a checkpoint is not whole, or None when it is: a file must be a torch.save zip
    archive whose every member passes its CRC-32 (bytes flipped anywhere are found, not only a
    missing end); a folder must hold every file its manifest lists, with its size and CRC-32.
    That reads it all, so the answer is kept while nothing in it changes: picking the newest
    checkpoint and then loading it read it once."""
    path = Path(path)
    try:
        if path.is_dir():
            signature = tuple(sorted((p.name, *_stat(p)) for p in path.iterdir()))
        else:
            check_regular(path, "checkpoint", _NOT_A_FILE.format(folder=path.parent))
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


def check_whole(path: Path, key: str) -> None:
    """Refuse, in one line naming `key`, a checkpoint that is empty or not whole."""
    if path.is_file() and path.stat().st_size == 0:
        raise refuse(f"{path} is empty (a checkpoint whose write never completed?)", key)
    why = why_not_whole(path)
    if why is not None:
        raise refuse(f"{path} is not a readable checkpoint ({why})", key)


# ---- what it holds ----


def load(path: Path, map_location: Any = "cpu", key: str = "trainer.resume") -> dict[str, Any]:
    """A checkpoint's state, read safely: a step file whole; a checkpoint folder's model (and
    EMA) assembled by DCP without a process group, and its step; an export folder's model and
    step. Every failure is one line naming the file and `key`."""
    path = Path(path)
    if path.is_dir() and (path / CONFIG).is_file():
        return read_state(path)
    if path.is_dir():
        return _sharded_state(path, key)
    state = read_archive(path, key, map_location)
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise refuse(f"{path} is not a hydra-ddp checkpoint (no model/step entries)", key)
    return state


def read_archive(path: Path, key: str, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """What a torch.save file holds, read with `torch.load(weights_only=True)` (`mmap`: tensors
    read from the file when used)."""
    path = Path(path)
    check_regular(path, "checkpoint", f"point {key} at a checkpoint file")
    if not path.exists():  # picked, then rotated away by a run in its dir (trainer.keep_ckpts)
        raise refuse(f"{path} was removed before it could be read", key)
    check_whole(path, key)
    try:
        with warnings.catch_warnings():
            # e.g. "Detected pickle protocol 4": noise next to the one-line error below.
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
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


def _sharded_state(path: Path, key: str) -> dict[str, Any]:
    """A checkpoint folder's model and EMA as plain CPU tensors, with its step, in the step
    file's layout ({"model": ..., "ema": ..., "step": ...})."""
    tensors = _dcp_tensors(path, ("model", "ema"), key)
    extra = read_archive(path / EXTRA, key)
    state: dict[str, Any] = {"step": int(extra["step"])}
    state["model"] = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
    if any(k.startswith("ema.") for k in tensors):
        state["ema"] = {f"module.{k[4:]}": v for k, v in tensors.items() if k.startswith("ema.")}
        state["ema"]["n_averaged"] = torch.tensor(int(extra.get("ema_n_averaged", 1)))
    return state


def _dcp_tensors(path: Path, members: tuple[str, ...], key: str) -> dict[str, torch.Tensor]:
    """The whole tensors of `members` in a checkpoint folder, by DCP key: DCP assembles each
    from every rank's shards, with no process group."""
    wanted = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in _dcp_index(path, key).items()
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


def _dcp_index(path: Path, key: str) -> dict[str, Any]:
    """A whole checkpoint folder's tensors (DCP's metadata), by DCP key."""
    check_whole(path, key)
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k: m for k, m in metadata.items() if isinstance(m, dcp.TensorStorageMetadata)}


# ---- weights, for trainer.init_from ----


@dataclass
class Weights:
    """Tensors in a file or folder: their names and shapes, and how to read one (on CPU)."""

    path: Path
    kind: str  # for the load line: "safetensors", "state dict", "checkpoint", ...
    shapes: dict[str, torch.Size]
    read: Callable[[str], torch.Tensor]
    # A checkpoint folder: a sharded model reads its own parts through DCP instead.
    dcp_folder: Path | None = None


def open_weights(value: str, key: str = INIT_FROM) -> Weights:
    """The weights `key=value` names (see the module's docstring for what it may be)."""
    path = Path(value)
    if is_sharded(path) or path.name == "checkpoints" or (path / "checkpoints").is_dir():
        return _from_checkpoint(named(value, key), key)
    if not path.is_dir():
        return _file(path, key)
    config = _json(path / CONFIG, key) if (path / CONFIG).is_file() else {}
    if MARK in config:  # an export: read_config says what a copy cut short lacks
        read_config(path)
    found = next((path / name for name in HF_FILES if (path / name).is_file()), None)
    if found is not None:
        return _file(found, key, "export" if MARK in config else "Hugging Face", shown=path)
    raise UserError(
        f"{key}={path}: the folder holds no weights (none of checkpoints/, {', '.join(HF_FILES)})"
        ": save a model's with model.save_pretrained(folder), or give a weights file, an export "
        "folder or a run dir"
    )


def _file(file: Path, key: str, kind: str = "safetensors", shown: Path | None = None) -> Weights:
    """A weights file, by its name: a safetensors index or file, else a torch.save file."""
    if file.name.endswith(".safetensors.index.json"):
        return _index(file, key)
    if file.suffix != ".safetensors":
        return _from_checkpoint(named(str(file), key), key)
    check_regular(file, "weights", f"point {key} at a .safetensors file")
    if not file.is_file():
        raise UserError(f"{key}={file}: no such file; give a weights file or folder")
    return _safetensors([file], shown or file, kind, key)


def _json(path: Path, key: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{key}: {path} is not readable JSON ({first_line(e, 120)})") from e
    if not isinstance(data, dict):
        raise UserError(f"{key}: {path} holds no JSON object")
    return data


def _index(path: Path, key: str) -> Weights:
    weight_map = _json(path, key).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise UserError(f"{key}={path}: the index has no weight_map of tensor names to files")
    files = {path.parent / str(file) for file in weight_map.values()}
    gone = sorted(f.name for f in files if not f.is_file())
    if gone:
        raise UserError(
            f"{key}={path}: the index names {', '.join(gone[:3])}, not in {path.parent}: "
            "copy the whole save_pretrained folder"
        )
    return _safetensors(sorted(files), path.parent, "Hugging Face, sharded", key)


def _safetensors(files: list[Path], path: Path, kind: str, key: str) -> Weights:
    """Each tensor's shape from the safetensors headers (checked against each file's size by
    safetensors itself: a header that lies is refused here, before any rank waits)."""
    shapes: dict[str, torch.Size] = {}
    where: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    shapes[name], where[name] = torch.Size(f.get_slice(name).get_shape()), file
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(
                f"{key}: {file} is not a readable safetensors file (its header does not "
                f"describe the file: {first_line(e, 120)}); save it again, or give another file"
            ) from e

    def read(name: str) -> torch.Tensor:
        with safe_open(str(where[name]), framework="pt") as f:
            return f.get_tensor(name)

    return Weights(path=path, kind=kind, shapes=shapes, read=read)


def _from_checkpoint(path: Path, key: str) -> Weights:
    """A checkpoint (its model), or a torch.save file holding a state dict."""
    if is_sharded(path):
        index = _dcp_index(path, key)
        shapes = {k[len("model.") :]: torch.Size(m.size) for k, m in index.items()
                  if k.startswith("model.")}  # fmt: skip
        # A whole model's load reads every tensor at once.
        whole = functools.cache(lambda: _dcp_tensors(path, ("model",), key))
        return Weights(path, "checkpoint, sharded", shapes, lambda n: whole()[f"model.{n}"], path)
    # mmap: a tensor's bytes are read when used, so a rank copies only its own parts.
    obj = read_archive(path, key, mmap=True)
    kind = "state dict"
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict) and "step" in obj:
        obj, kind = obj["model"], "checkpoint"
    elif isinstance(obj, dict) and not _tensors(obj):
        obj = next((obj[k] for k in ("model", "state_dict") if isinstance(obj.get(k), dict)), {})
    tensors = _tensors(obj) if isinstance(obj, dict) else {}
    if not tensors:
        raise UserError(
            f"{key}={path} holds no state dict (no tensors by name, nor under a model or "
            "state_dict entry): save one with torch.save(model.state_dict(), file)"
        )
    return Weights(path, kind, {k: v.shape for k, v in tensors.items()}, tensors.__getitem__)


def _tensors(obj: dict) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return {k: v for k, v in obj.items() if isinstance(k, str) and torch.is_tensor(v)}
