"""Weights as people have them, opened without reading them: what `trainer.init_from` names.

`open_weights(value)` recognises, in this order:

- a sharded checkpoint folder of this template (`*.dcp`, ddp=fsdp2);
- a folder of `python -m hydra_ddp.export` (`config.json` with a `hydra_ddp` entry and
  `model.safetensors`);
- a Hugging Face `save_pretrained` folder: `model.safetensors`, a sharded
  `model.safetensors.index.json`, or `pytorch_model.bin`;
- a run dir of this template (its newest complete checkpoint);
- a `.safetensors` file, or a `*.safetensors.index.json`;
- a `torch.save` file: a checkpoint of this template (its `model` entry), or a bare state dict
  (`torch.save(model.state_dict())`, `.pt` or `.bin`), or a dict holding one under `model` or
  `state_dict` (e.g. Lightning's).

A `Weights` knows each tensor's name and shape from the file's index alone and reads one
tensor at a time (`torch.load(mmap=True)`, safetensors' own lazy reads), so that each rank of a
sharded job copies only its parts (checkpoint/init.py). Every refusal is one line naming the
file and what to do.
"""

from __future__ import annotations

import functools
import json
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open

from hydra_ddp.checkpoint import dcp_files
from hydra_ddp.checkpoint.reading import file_or_newest, read_archive
from hydra_ddp.disk import check_regular
from hydra_ddp.errors import UserError, first_line

KEY = "trainer.init_from"
INDEX = "model.safetensors.index.json"
# What save_pretrained writes, in the order from_pretrained prefers them.
HF_FILES = ("model.safetensors", INDEX, "pytorch_model.bin")
EXPORT_MARK = "hydra_ddp"  # the entry of an export's config.json that says it is one


@dataclass
class Weights:
    """Tensors in a file or folder: their names and shapes, and how to read one (on CPU)."""

    path: Path
    kind: str  # for the load line: "safetensors", "state dict", "checkpoint", ...
    shapes: dict[str, torch.Size]
    read: Callable[[str], torch.Tensor]
    # A sharded checkpoint folder: a sharded model reads its own parts through DCP instead.
    dcp_folder: Path | None = None


def open_weights(value: str, key: str = KEY) -> Weights:
    """The weights `key=value` names (see the module's docstring for what it may be)."""
    path = Path(value)
    if path.is_dir() and path.suffix == dcp_files.SUFFIX:
        return _dcp(path)
    if path.is_dir() and (path / "checkpoints").is_dir() or path.name == "checkpoints":
        return _from_file(file_or_newest(value, key, f"no {key}"), key)
    if path.is_dir():
        return _folder(path, key)
    if path.name.endswith(".safetensors.index.json"):
        return _index(path, key)
    if path.suffix == ".safetensors":
        check_regular(path, "weights", f"point {key} at a .safetensors file")
        if not path.is_file():
            raise UserError(f"{key}={value}: no such file; give a weights file or folder")
        return _safetensors({n: path for n in _header(path, key)}, path, "safetensors", key)
    return _from_file(file_or_newest(value, key, f"no {key}"), key)


def _folder(path: Path, key: str) -> Weights:
    config = _json(path / "config.json", key) if (path / "config.json").is_file() else {}
    if EXPORT_MARK in config:
        if not (path / "model.safetensors").is_file():
            raise UserError(
                f"{key}={path}: this export folder has no model.safetensors (a copy cut "
                "short?): export the run again with python -m hydra_ddp.export run=<run dir>"
            )
        return _safetensors(
            {n: path / "model.safetensors" for n in _header(path / "model.safetensors", key)},
            path, "export", key,
        )  # fmt: skip
    if (path / "model.safetensors").is_file():
        file = path / "model.safetensors"
        return _safetensors({n: file for n in _header(file, key)}, path, "Hugging Face", key)
    if (path / INDEX).is_file():
        return _index(path / INDEX, key)
    if (path / "pytorch_model.bin").is_file():
        return _from_file(path / "pytorch_model.bin", key)
    if config:
        raise UserError(
            f"{key}={path}: a Hugging Face folder with no weights (config.json, but none of "
            f"{', '.join(HF_FILES)}): save them with model.save_pretrained(folder), or point "
            f"{key} at the weights file"
        )
    raise UserError(
        f"{key}={path}: the folder holds no weights (no checkpoints/, no {', '.join(HF_FILES)}, "
        "no export's config.json): give a weights file, a save_pretrained or export folder, or "
        "a run dir"
    )


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
    files = {name: path.parent / str(file) for name, file in weight_map.items()}
    gone = sorted({f.name for f in files.values() if not f.is_file()})
    if gone:
        raise UserError(
            f"{key}={path}: the index names {', '.join(gone[:3])}, not in {path.parent}: "
            "copy the whole save_pretrained folder"
        )
    for file in set(files.values()):
        _header(file, key)
    return _safetensors(files, path.parent, "Hugging Face, sharded", key)


def _header(file: Path, key: str) -> dict[str, torch.Size]:
    """Each tensor's shape, from the safetensors header (checked against the file's size by
    safetensors itself: a header that lies is refused here, before any rank waits)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            return {name: torch.Size(f.get_slice(name).get_shape()) for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(
            f"{key}: {file} is not a readable safetensors file (its header does not "
            f"describe the file: {first_line(e, 120)}); save it again, or give another file"
        ) from e


def _safetensors(files: dict[str, Path], path: Path, kind: str, key: str) -> Weights:
    shapes: dict[str, torch.Size] = {}
    for file in sorted(set(files.values())):
        shapes.update(_header(file, key))

    def read(name: str) -> torch.Tensor:
        with safe_open(str(files[name]), framework="pt") as f:
            return f.get_tensor(name)

    return Weights(path=path, kind=kind, shapes={n: shapes[n] for n in files}, read=read)


def _dcp(path: Path) -> Weights:
    why = dcp_files.dcp_folder_damage(path)
    if why is not None:
        raise UserError(f"{KEY}={path}: not a readable checkpoint ({why}); give another one")
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    shapes = {
        k[len("model.") :]: torch.Size(m.size)
        for k, m in metadata.items()
        if k.startswith("model.") and isinstance(m, dcp.TensorStorageMetadata)
    }

    @functools.cache
    def whole() -> dict[str, torch.Tensor]:  # a whole model's load: every tensor at once
        wanted = {f"model.{k}": torch.empty(v, dtype=metadata[f"model.{k}"].properties.dtype)
                  for k, v in shapes.items()}  # fmt: skip
        with warnings.catch_warnings():
            # "torch.distributed is ... uninitialized, assuming ... a single process": just so.
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(wanted, checkpoint_id=str(path), no_dist=True)
        return {k[len("model.") :]: v for k, v in wanted.items()}

    return Weights(path, "checkpoint, sharded", shapes, lambda n: whole()[n], dcp_folder=path)


def _from_file(path: Path, key: str) -> Weights:
    """A torch.save file (or a .dcp folder a run dir's newest checkpoint is)."""
    if dcp_files.is_checkpoint(path):
        return _dcp(path)
    # mmap: a tensor's bytes are read when used, so a rank copies only its own parts.
    obj = read_archive(path, key, mmap=zipfile.is_zipfile(path))
    kind = "state dict"
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict) and "step" in obj:
        obj, kind = obj["model"], "checkpoint"
    elif isinstance(obj, dict) and not _tensors(obj):
        inner = next((obj[k] for k in ("model", "state_dict") if isinstance(obj.get(k), dict)), {})
        obj = inner
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
