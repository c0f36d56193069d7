"""What a checkpoint holds: the members a job declares when it is built (`members`: the
template's `DEFAULT_MEMBERS`, then the user's, as docs/extending.md shows), handed to both
checkpointers. A member whose `get` returns None (the job has no EMA, no comm hook) is neither
saved nor loaded; resume loads the members in the table's order.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from hydra_ddp.distributed import DistEnv
from hydra_ddp.errors import UserError, first_line

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class CheckpointedObjects:
    """This job's checkpointed objects, as the loop holds them (None: the job has none)."""

    model: torch.nn.Module
    optimizers: Any = None  # optim.Optimizers: the optimizers and their schedules
    scaler: Any = None
    ema: Any = None  # loop.wrapping.EMA
    monitor: Any = None
    callbacks: Any = None
    position: Any = None  # loop.position.PositionState: the position and its resume arithmetic
    comm_hook: Any = None  # a DDP comm hook's per-rank state (PowerSGD's error feedback)
    device: torch.device = torch.device("cpu")
    sharded: bool = False  # ddp=fsdp2: model, optimizer and EMA are DTensor shards


@dataclass(frozen=True)
class Member:
    name: str  # its key in the checkpoint
    get: Callable[[CheckpointedObjects], Stateful | None]
    # A checkpoint without it is refused; else (a feature switched on later) it starts fresh.
    required: bool = False
    # Every rank's own state, in the checkpoint's `rng` list (by rank); else global, by rank 0.
    per_rank: bool = False
    # ddp=fsdp2 keeps it in DCP's shards (each rank its part); else in extra.pt.
    sharded: bool = False
    # Its keys sit at the checkpoint's top level, and it is given the whole checkpoint.
    flat: bool = False
    # per_rank: also restored from a checkpoint of another world size (rank r's state, if any).
    any_world: bool = False
    # per_rank, once global: a rank without its own state takes rank 0's, else the top level's.
    was_global: bool = False


class ModelState:
    """The unwrapped model; ddp=fsdp2: its shards, by parameter name (any number of ranks)."""

    def __init__(self, model: torch.nn.Module, sharded: bool) -> None:
        self.model, self.sharded = model, sharded

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model) if self.sharded else self.model.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.sharded:
            set_model_state_dict(self.model, state)
        else:
            load_model_state(self.model, state, loading_from())


def load_model_state(
    model: torch.nn.Module, state: dict[str, Any], path: Path, hint: str = "or trainer.resume=never"
) -> None:
    """Load weights, turning a shape mismatch (a checkpoint of another model) into one line."""
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        wrong = ("size mismatch", "Missing key", "Unexpected key")
        lines = str(e).splitlines()
        detail = next((ln.strip() for ln in lines if any(w in ln for w in wrong)), lines[0])
        raise UserError(
            f"{path} is a checkpoint of a different model ({detail[:300]}): resume with the "
            f"model config it was trained with (its run's .hydra/config.yaml), {hint}"
        ) from e


class OptimizerState:
    """The optimizers (one as it always was, several by name; ddp=fsdp2: always by name, each
    rank its shards), loaded with this job's optim.* settings (optim.load_optimizers)."""

    def __init__(self, optimizers: Any, model: torch.nn.Module, sharded: bool) -> None:
        self.optimizers, self.model, self.sharded = optimizers, model, sharded

    def state_dict(self) -> dict[str, Any]:
        if not self.sharded:
            return self.optimizers.state_dict()
        return {
            name: get_optimizer_state_dict(self.model, optimizer)
            for name, optimizer in self.optimizers.optimizers.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.sharded:
            self.optimizers.load_optimizers(state, loading_from())
            return
        if self.optimizers.single and "default" in state:
            state = state["default"]
        into_shards = functools.partial(set_optimizer_state_dict, self.model)
        self.optimizers.load_optimizers(state, loading_from(), into_shards)


def _ema(objects: CheckpointedObjects) -> Stateful | None:
    """The average: AveragedModel's own layout; ddp=fsdp2: its shards (its count: _ema_count)."""
    if objects.ema is None or not objects.sharded:
        return objects.ema
    return ModelState(objects.ema.module, sharded=True)


def _ema_count(objects: CheckpointedObjects) -> Stateful | None:
    """ddp=fsdp2: the average's update count, in extra.pt (a plain int is no shard)."""
    ema = objects.ema
    if ema is None or not objects.sharded:
        return None
    return SimpleNamespace(
        state_dict=lambda: {"ema_n_averaged": ema.n_averaged},
        load_state_dict=lambda state: setattr(
            ema, "n_averaged", int(state.get("ema_n_averaged", 1))
        ),
    )


def _schedules(objects: CheckpointedObjects) -> Stateful | None:
    optimizers = objects.optimizers
    if optimizers is None:
        return None
    return SimpleNamespace(
        state_dict=optimizers.scheduler_state, load_state_dict=optimizers.load_schedules
    )


def _opt(objects: CheckpointedObjects) -> Stateful | None:
    if objects.optimizers is None:
        return None
    return OptimizerState(objects.optimizers, objects.model, objects.sharded)


def _rng(objects: CheckpointedObjects) -> Stateful:
    """This rank's random number generators (dropout masks, augmentation)."""
    device = objects.device

    def save() -> dict[str, Any]:
        mine = {"torch": torch.get_rng_state()}
        if device.type == "cuda":
            mine["cuda"] = torch.cuda.get_rng_state(device)
        return mine

    def load(state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"].cpu())
        if device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"].cpu(), device)

    return SimpleNamespace(state_dict=save, load_state_dict=load)


# The template's members, in load order (the schedules before the optimizers).
DEFAULT_MEMBERS: tuple[Member, ...] = (
    Member("model", lambda p: ModelState(p.model, p.sharded), required=True, sharded=True),
    Member("scheduler", _schedules, required=True),
    Member("optimizer", _opt, required=True, sharded=True),
    Member("scaler", lambda p: p.scaler, required=True),
    Member("ema", _ema, sharded=True),
    Member("ema_n_averaged", _ema_count, flat=True),
    Member("monitor", lambda p: p.monitor),
    # Each rank's callbacks keep their own state (a callback may count what its rank saw).
    Member("callbacks", lambda p: p.callbacks, per_rank=True, any_world=True, was_global=True),
    Member("position", lambda p: p.position, required=True, flat=True),
    Member("rng", _rng, per_rank=True, flat=True, any_world=True),
    Member("comm_hook", lambda p: p.comm_hook, per_rank=True),
)


def members(extra: Iterable[Member] = ()) -> list[Member]:
    """A job's members: the defaults, then `extra` (the user's) in order; one named as a default
    replaces it, where the default loads."""
    table = {m.name: m for m in DEFAULT_MEMBERS}  # a name given again keeps its place
    for member in extra:
        if not isinstance(member, Member):
            raise UserError(
                f"checkpoint_members() gave {member!r}: return "
                "hydra_ddp.checkpoint.state.Member objects"
            )
        table[member.name] = member
    return list(table.values())


_LOADING: ContextVar[Path | None] = ContextVar("checkpoint_loading", default=None)


def loading_from() -> Path | None:
    """The checkpoint being restored, for a member's messages (None: none is)."""
    return _LOADING.get()


@contextlib.contextmanager
def restoring(path: Path) -> Iterator[None]:
    token = _LOADING.set(Path(path))
    try:
        yield
    finally:
        _LOADING.reset(token)


def load_members(
    members: list[tuple[Member, Stateful]], state: dict[str, Any], env: DistEnv, path: Path
) -> None:
    """Load each member from the checkpoint `state` (per-rank ones from `state["rng"]`)."""
    ranks = state.get("rng") or []
    same_world = int(state.get("world_size") or env.world_size) == env.world_size
    mine = ranks[env.rank] if env.rank < len(ranks) else None
    with restoring(path):
        for member, obj in members:
            if member.per_rank:
                found = mine if (same_world or member.any_world) else None
                where = f" for rank {env.rank}"
                if member.was_global and not _holds(found, member):
                    found = next((s for s in (*ranks[:1], state) if _holds(s, member)), None)
            else:
                found, where = state, ""
            if not _holds(found, member):
                if member.required:
                    raise UserError(
                        f"{path} holds no {member.name} state{where}, which this job needs: "
                        "resume with the config it was trained with, or trainer.resume=never"
                    )
                # A checkpoint from before the feature was switched on (or of another world size).
                log.warning("%s holds no %s state%s: starting it fresh", path, member.name, where)
                continue
            try:
                obj.load_state_dict(found if member.flat else found[member.name])
            except (KeyError, ValueError, RuntimeError, TypeError, IndexError) as e:
                raise UserError(
                    f"{path} does not match this job's {member.name} ({type(e).__name__}: "
                    f"{first_line(e)}): resume with the config it was trained with (its run's "
                    ".hydra/config.yaml; optim.*, scheduler.* ...), or trainer.resume=never"
                ) from e


def _holds(found: dict[str, Any] | None, member: Member) -> bool:
    return found is not None and (member.flat or member.name in found)
