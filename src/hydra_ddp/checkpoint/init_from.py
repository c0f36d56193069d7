"""`trainer.init_from`: start a model from weights of any format (reader.open_weights), with
`trainer.init_map`'s prefix renames, and one line saying what was loaded.

In two parts, so that bad input fails before any process group and a sharded model is loaded
in place: `plan` matches names and shapes from the file's index alone (tensors read: none), on
the model as built (whole, or on the meta device); `apply` copies the planned tensors, into the
whole model (DDP) or, after ddp=fsdp2's wrap, into each rank's shards: from a sharded checkpoint
folder each rank reads its own parts through DCP, from any other file each rank reads one
tensor at a time (memory-mapped) and keeps its own slice of it. Tied tensors (one parameter
under two names, as a GPT's embedding and head) count as loaded when either name is: an HF or
export file stores them once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, distribute_tensor

from hydra_ddp.checkpoint.reader import INIT_FROM, Weights, open_weights
from hydra_ddp.errors import UserError

log = logging.getLogger(__name__)

SHOWN = 3  # names shown per kind of mismatch in the load line


@dataclass
class LoadPlan:
    """Which tensor of the file goes into which of the model, and what did not fit."""

    weights: Weights
    pairs: dict[str, str]  # the model's name -> the file's name
    missing: list[str] = field(default_factory=list)  # the model's, kept as initialised
    unexpected: list[str] = field(default_factory=list)  # the file's, unused
    reshaped: list[str] = field(default_factory=list)  # same name, another shape: refused

    def summary(self) -> str:
        """Counts, then the first few names of each kind of mismatch."""
        counts = (
            f"{len(self.pairs)} matched, {len(self.missing)} missing, "
            f"{len(self.unexpected)} unexpected, {len(self.reshaped)} reshaped-refused tensors"
        )
        kinds = (("missing", self.missing), ("unexpected", self.unexpected),
                 ("reshaped-refused", self.reshaped))  # fmt: skip
        return counts + "".join(f"; {what}: {_first(names)}" for what, names in kinds if names)

    def line(self) -> str:
        """The load line."""
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
        f"{k} ({_shape(weights.shapes[theirs[k]])} in the file, {_shape(mine[k])} here)"
        for k in mine
        if k in theirs and k not in pairs
    ]
    loaded = set(pairs)
    for names in _tied(model):
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
    """trainer.init_from, before any process group: its names and shapes checked against
    `model`, then loaded into it now, or (`sharded`: ddp=fsdp2) returned to be loaded into each
    rank's shards after the wrap. Nothing when a checkpoint is resumed (`resume_from`)."""
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
    """Copy the planned tensors into `model`: whole, or (ddp=fsdp2, after the wrap) each rank
    its own shards. Collective for a sharded model and a sharded checkpoint folder (every rank
    calls it). Logs the load line."""
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


def init_weights(
    model: torch.nn.Module, source: str, strict: bool, init_map: Mapping[str, str] | None = None
) -> Path:
    """trainer.init_from into a whole model: plan, then apply. Returns what was read."""
    planned = plan(model, open_weights(source), init_map, strict)
    apply(model, planned)
    return planned.weights.path


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
    named = chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    )
    for name, tensor in named:
        groups.setdefault(id(tensor), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _shape(shape: torch.Size) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _first(names: list[str]) -> str:
    more = f" (+{len(names) - SHOWN} more)" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more
