"""`trainer.init_from`: start a model from weights of any format docs/weights.md lists, with
`trainer.init_map`'s prefix renames, and one line saying what was loaded. `plan` matches names
and shapes from the file's index alone, so bad input fails before any process group; `apply`
copies the tensors into the whole model, or after ddp=fsdp2's wrap into each rank's shards.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from torch.distributed.tensor import DTensor, distribute_tensor

from hydra_ddp.checkpoint.reader import dcp_index, dcp_tensors, is_sharded, named, read_archive
from hydra_ddp.disk import check_regular
from hydra_ddp.errors import UserError, first_line
from hydra_ddp.export_format import CONFIG, MARK, WEIGHTS, read_config

log = logging.getLogger(__name__)

INIT_FROM = "trainer.init_from"
INDEX = "model.safetensors.index.json"
# What save_pretrained writes, in the order from_pretrained prefers them.
HF_FILES = (WEIGHTS, INDEX, "pytorch_model.bin")
SHOWN = 3  # names shown per kind of mismatch in the load line


# ---- the file ----


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
    """The weights `key=value` names, opened without reading them."""
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
    """Each tensor's shape from the safetensors headers, which safetensors checks against the
    file's size: a header that lies is refused here, before any rank waits."""
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
        index = dcp_index(path, key)
        shapes = {k[len("model.") :]: torch.Size(m.size) for k, m in index.items()
                  if k.startswith("model.")}  # fmt: skip
        # A whole model's load reads every tensor at once.
        whole = functools.cache(lambda: dcp_tensors(path, ("model",), key))
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
    return {k: v for k, v in obj.items() if isinstance(k, str) and torch.is_tensor(v)}


# ---- the model ----


@dataclass
class LoadPlan:
    """Which tensor of the file goes into which of the model, and what did not fit."""

    weights: Weights
    pairs: dict[str, str]  # the model's name -> the file's name
    missing: list[str] = field(default_factory=list)  # the model's, kept as initialised
    unexpected: list[str] = field(default_factory=list)  # the file's, unused
    reshaped: list[str] = field(default_factory=list)  # same name, another shape: refused

    def summary(self) -> str:
        counts = (
            f"{len(self.pairs)} matched, {len(self.missing)} missing, "
            f"{len(self.unexpected)} unexpected, {len(self.reshaped)} reshaped-refused tensors"
        )
        kinds = (("missing", self.missing), ("unexpected", self.unexpected),
                 ("reshaped-refused", self.reshaped))  # fmt: skip
        return counts + "".join(f"; {what}: {_first(names)}" for what, names in kinds if names)

    def line(self) -> str:
        return f"{INIT_FROM}: {self.weights.path} ({self.weights.kind}): {self.summary()}"


def rename(name: str, init_map: Mapping[str, str]) -> str:
    """The file's tensor name under this model: the longest `init_map` prefix replaced."""
    prefix = max((p for p in init_map if name.startswith(p)), key=len, default=None)
    return name if prefix is None else init_map[prefix] + name[len(prefix) :]


def plan(
    model: torch.nn.Module,
    weights: Weights,
    init_map: Mapping[str, str] | None = None,
    strict: bool = True,
) -> LoadPlan:
    """Match the file's tensors to the model's by name (after `init_map`) and shape. `strict`:
    anything missing, unexpected or reshaped is refused in one line naming the first ones."""
    mine = {k: v.shape for k, v in model.state_dict().items()}
    theirs: dict[str, str] = {}
    for name in weights.shapes:
        theirs.setdefault(rename(name, init_map or {}), name)
    pairs = {k: theirs[k] for k in mine if k in theirs and weights.shapes[theirs[k]] == mine[k]}
    reshaped = [
        f"{k} ({list(weights.shapes[theirs[k]])} in the file, {list(mine[k])} here)"
        for k in mine
        if k in theirs and k not in pairs
    ]
    loaded = set(pairs)
    for names in _tied(model):  # an HF or export file stores a tied tensor (a GPT's head) once
        if loaded & set(names):
            loaded.update(names)
    result = LoadPlan(
        weights=weights,
        pairs=pairs,
        missing=[k for k in mine if k not in loaded and k not in theirs],
        unexpected=[theirs[k] for k in theirs if k not in mine],
        reshaped=reshaped,
    )
    if strict and (result.missing or result.unexpected or result.reshaped):
        raise UserError(
            f"{INIT_FROM}={weights.path} ({weights.kind}) does not fit this model: "
            f"{result.summary()}. Give weights of "
            "this model, rename the file's keys with trainer.init_map (a prefix each, e.g. "
            "'trainer.init_map={transformer.:\"\"}'), or load what fits with "
            "trainer.init_strict=false"
        )
    return result


def for_fresh_run(
    model: torch.nn.Module,
    init_from: str | None,
    resume_from: Path | None,
    *,
    init_map: Mapping[str, str] | None = None,
    strict: bool = True,
    sharded: bool = False,
) -> LoadPlan | None:
    """trainer.init_from, before any process group: planned against `model`, then loaded now,
    or (`sharded`) returned to be applied to each rank's shards after the wrap. Nothing when
    a checkpoint is resumed."""
    if not init_from:
        return None
    if resume_from is not None:
        log.info("trainer.init_from=%s not used: resuming %s", init_from, resume_from)
        return None
    planned = plan(model, open_weights(init_from), init_map, strict)
    if sharded:
        return planned
    apply(model, planned)
    return None


def apply(model: torch.nn.Module, planned: LoadPlan, distributed: bool = False) -> None:
    """Copy the planned tensors into `model`, and log the load line. Collective for a sharded
    model and a checkpoint folder."""
    mine = model.state_dict()
    sharded = any(isinstance(mine[k], DTensor) for k in planned.pairs)
    folder = planned.weights.dcp_folder
    if sharded and folder is not None:  # DCP reads each rank's own parts of each tensor
        state = {
            f"model.{theirs}": torch.empty_like(mine[k]) for k, theirs in planned.pairs.items()
        }
        dcp.load(state, checkpoint_id=str(folder), no_dist=not distributed)  # collective
        fits = {k: state[f"model.{theirs}"] for k, theirs in planned.pairs.items()}
    else:
        fits = {
            k: _part(planned.weights.read(theirs), mine[k]) for k, theirs in planned.pairs.items()
        }
    with torch.no_grad():
        model.load_state_dict(fits, strict=False)
    whole = not (planned.missing or planned.unexpected or planned.reshaped)
    (log.info if whole else log.warning)("%s", planned.line())


def _part(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`full` as `target` holds it: whole, or this rank's shard of a DTensor (sliced on the CPU
    as fully_shard slices it, torch.chunk along each sharded dim)."""
    if not isinstance(target, DTensor):
        return full
    mesh, placements = target.device_mesh, target.placements
    part, coordinate = full, mesh.get_coordinate() or []
    for dim, placement in enumerate(placements):
        if placement.is_shard():
            chunks = torch.chunk(part, mesh.size(dim), dim=placement.dim)
            index = coordinate[dim]
            part = chunks[index] if index < len(chunks) else part.narrow(placement.dim, 0, 0)
    local = target.to_local()
    if part.shape != local.shape:  # another layout than fully_shard's: let DTensor slice it
        return distribute_tensor(full.to(local.dtype), mesh, placements, src_data_rank=None)
    part = part.to(device=local.device, dtype=local.dtype)
    return DTensor.from_local(part, mesh, placements, shape=target.shape, stride=target.stride())


def _tied(model: torch.nn.Module) -> list[list[str]]:
    """Names that are one tensor (tied weights): each group of two or more."""
    groups: dict[int, list[str]] = {}
    named_tensors = chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    )
    for name, tensor in named_tensors:
        groups.setdefault(id(tensor), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _first(names: list[str]) -> str:
    more = f" (+{len(names) - SHOWN} more)" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more
