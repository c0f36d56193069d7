"""What a checkpoint holds: the members a job declares when it is built (`members`: the
template's `DEFAULT_MEMBERS` and the user's), handed to both checkpointers.

Every member is an object with `state_dict()` / `load_state_dict(state)` (torch's
`torch.distributed.checkpoint.stateful.Stateful`), taken from this job's
`CheckpointedObjects` by its entry's `get`; a member the job lacks (no EMA, no comm hook) gets
None and is neither saved nor loaded.
Resume loads the members in the table's order. An entry says:

    required   a checkpoint without it is refused; else (a feature switched on later) the
               member starts fresh, with a warning
    per_rank   every rank's own state, kept in the checkpoint's `rng` list (index: rank);
               else global, saved by rank 0 (ddp=fsdp2: by every rank when `sharded`)
    was_global per_rank, once global (the callbacks): a rank the checkpoint holds no state of
               its own for takes rank 0's, and a checkpoint written when it was global gives
               that one state to every rank
    sharded    ddp=fsdp2 keeps it in DCP's shards (each rank its part); else in extra.pt
    flat       its keys sit at the top level of the checkpoint (the position's step, epoch...),
               and its load_state_dict is given the whole checkpoint (it reads what is there)

Changing what the template's checkpoints hold is one entry of `DEFAULT_MEMBERS`. A user's own
object joins through a callback (callbacks.py) whose `checkpoint_members()` returns its
members, e.g. `[Member("counter", lambda objects: self.counter)]`: the job asks every callback
when it is built, on every rank alike (loop/checkpointing.py).
"""

from __future__ import annotations

import contextlib
import logging
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from hydra_ddp.distributed import DistEnv
from hydra_ddp.errors import UserError, first_line

log = logging.getLogger(__name__)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


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
    required: bool = False
    per_rank: bool = False
    sharded: bool = False
    flat: bool = False
    # per_rank: also restored from a checkpoint of another world size (rank r's state, if any)
    any_world: bool = False
    # per_rank: rank 0's state, else the top-level one, for a rank without its own (see above)
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
            return
        load_model_state(self.model, {"model": state}, loading_from())


def load_model_state(
    model: torch.nn.Module, state: dict[str, Any], path: Path, hint: str = "or trainer.resume=never"
) -> None:
    """Load weights, turning a shape mismatch (a checkpoint of another model) into one line."""
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        wrong = ("size mismatch", "Missing key", "Unexpected key")
        lines = str(e).splitlines()
        detail = next((ln.strip() for ln in lines if any(w in ln for w in wrong)), lines[0])
        raise UserError(
            f"{path} is a checkpoint of a different model ({detail[:300]}): resume with the "
            f"model config it was trained with (its run's .hydra/config.yaml), {hint}"
        ) from e


class SchedulerState:
    """The optimizers' schedules (one, or a dict by optimizer name)."""

    def __init__(self, optimizers: Any) -> None:
        self.optimizers = optimizers

    def state_dict(self) -> dict[str, Any]:
        return self.optimizers.scheduler_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizers.load_schedules(state)


class OptimizerState:
    """The optimizers (one as it always was, several as a dict by name; ddp=fsdp2: always by
    name, each rank its shards). Loaded after the schedules, with this job's optim.* settings
    applied to both (optim.load_optimizer_state), whichever the wrapper."""

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

        def into_shards(optimizer: torch.optim.Optimizer, saved: dict) -> None:
            set_optimizer_state_dict(self.model, optimizer, saved)

        self.optimizers.load_optimizers(state, loading_from(), into_shards)


class EMAState:
    """trainer.ema_decay's average: `module.<name>` and `n_averaged` (AveragedModel's layout);
    ddp=fsdp2: its shards, with the count beside them (EMACount)."""

    def __init__(self, ema: Any, sharded: bool) -> None:
        self.ema, self.sharded = ema, sharded

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.ema.module) if self.sharded else self.ema.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.sharded:
            set_model_state_dict(self.ema.module, state)
        else:
            self.ema.load_state_dict(state)


class EMACount:
    """ddp=fsdp2: the average's update count, in extra.pt (a plain int is no shard)."""

    def __init__(self, ema: Any) -> None:
        self.ema = ema

    def state_dict(self) -> dict[str, Any]:
        return {"ema_n_averaged": self.ema.n_averaged}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema.n_averaged = int(state.get("ema_n_averaged", 1))


class RNGState:
    """This rank's random number generators (dropout masks, augmentation)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        mine = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            mine["cuda"] = torch.cuda.get_rng_state(self.device)
        return mine

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"].cpu())
        if self.device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"].cpu(), self.device)


def _ema(objects: CheckpointedObjects) -> Stateful | None:
    return EMAState(objects.ema, objects.sharded) if objects.ema is not None else None


def _ema_count(objects: CheckpointedObjects) -> Stateful | None:
    return EMACount(objects.ema) if objects.ema is not None and objects.sharded else None


def _schedules(objects: CheckpointedObjects) -> Stateful | None:
    return SchedulerState(objects.optimizers) if objects.optimizers is not None else None


def _opt(objects: CheckpointedObjects) -> Stateful | None:
    if objects.optimizers is None:
        return None
    return OptimizerState(objects.optimizers, objects.model, objects.sharded)


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
    Member("rng", lambda p: RNGState(p.device), per_rank=True, flat=True, any_world=True),
    Member("comm_hook", lambda p: p.comm_hook, per_rank=True),
)


def members(extra: Iterable[Member] = ()) -> list[Member]:
    """A job's members: the defaults, then `extra` (the user's) in order; one of the user's
    named as a default replaces it, where the default loads, and a later one of the same name
    replaces an earlier one."""
    table = list(DEFAULT_MEMBERS)
    for member in extra:
        if not isinstance(member, Member):
            raise UserError(
                f"checkpoint_members() gave {member!r}: return "
                "hydra_ddp.checkpoint.state.Member objects"
            )
        names = [m.name for m in table]
        if member.name in names:
            table[names.index(member.name)] = member
        else:
            table.append(member)
    return table


def held_members(
    objects: CheckpointedObjects, table: Iterable[Member] = DEFAULT_MEMBERS
) -> list[tuple[Member, Stateful]]:
    """This job's members (`table`, from `members`) and their objects, in the table's order."""
    found = ((m, m.get(objects)) for m in table)
    return [(m, obj) for m, obj in found if obj is not None]


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
                _missing(member, path, where)
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


def _missing(member: Member, path: Path, where: str) -> None:
    if member.required:
        raise UserError(
            f"{path} holds no {member.name} state{where}, which this job needs: resume with "
            "the config it was trained with, or trainer.resume=never"
        )
    # A checkpoint from before the feature was switched on (or of another world size).
    log.warning("%s holds no %s state%s: starting it fresh", path, member.name, where)
