"""Writing checkpoints: a DistributedDataParallel run's single files, what every checkpoint may
hold, and the checkpoints/ folder a run writes into.

- `Checkpointer`: checkpoints/step_<step>.pt, written by global rank 0 with every member the
  job declared (state.py); ddp=fsdp2's sharded folders are dcp.py's, with the same interface.
- `save`: temporary file, fsync, rename, then the newest K kept; `keep_as_best`: best.pt.
- `loadable`: state made plain at save. Resume and evaluation read checkpoints with
  `torch.load(weights_only=True)`, which refuses any object whose class it does not know (it
  would have to import and call code). So numpy scalars become Python numbers, numpy arrays
  tensors (lists for arrays of strings or objects), tuple/dict/list subclasses (a namedtuple, a
  defaultdict), frozensets and paths their plain counterparts. Anything else (a user's class,
  an Enum, a datetime) is refused at save, in one line naming where it is, rather than found at
  resume when the run can no longer be continued. Containers in which nothing changes are kept
  as they are (a model's state_dict keeps its `_metadata`).
- `check_folder`, `set_aside_checkpoints`: the folder before a run writes into it.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from hydra_ddp.checkpoint import state
from hydra_ddp.checkpoint.reader import checkpoint_dir, is_sharded, load, steps
from hydra_ddp.disk import file_too_large, over_size_limit, remove_quietly, write_failed
from hydra_ddp.distributed import DistEnv, all_gather_objects, barrier
from hydra_ddp.distributed.ddp import sync_buffers
from hydra_ddp.errors import UserError

log = logging.getLogger(__name__)

_TMP = re.compile(r"^\.step_\d{8}\.pt\.(\d+)\.tmp$")


class Checkpointer:
    """The training state on disk: `maybe_save` every trainer.ckpt_interval steps, `save` at
    the end or on a stop signal, `restore` on resume.

    `objects` are what this job checkpoints; what of them a checkpoint holds, and how, is
    `members` (state.members: the defaults and the user's). Rank 0 saves the global members;
    the per-rank ones (every rank's RNG and callback state, a comm hook's error feedback) are
    gathered into the same file. Every rank first takes rank 0's buffers (`agree`). Saving
    and restoring are collective: every rank calls them.
    """

    sharded = False  # ddp=fsdp2's subclass writes and resumes checkpoint folders

    def __init__(
        self,
        output_dir: Path,
        env: DistEnv,
        objects: state.CheckpointedObjects,
        members: Iterable[state.Member] = state.DEFAULT_MEMBERS,
        *,
        interval: int = 0,
        keep: int = 1,
        total_steps: int = 0,
    ) -> None:
        self.output_dir, self.env, self.objects = Path(output_dir), env, objects
        self.interval, self.keep, self.total_steps = interval, keep, total_steps
        self.members = state.held_members(objects, members)

    @property
    def step(self) -> int:
        """The optimizer steps the position has taken (0 without a position)."""
        position = self.objects.position
        return int(position.pos.step) if position is not None else 0

    def due(self, step: int) -> bool:
        """Every `interval` steps (0: never); the end of the run saves anyway."""
        return bool(self.interval) and step % self.interval == 0 and step < self.total_steps

    def maybe_save(self) -> None:
        """Collective."""
        if self.due(self.step):
            self.save()

    def save(self, name: str | None = None) -> None:
        """Collective: gather every rank's per-rank state, then global rank 0 alone writes
        checkpoints/step_<step>.pt, or checkpoints/<name> (the best one, never rotated)."""
        env = self.env
        agree(self.objects, env)  # collective
        main, refused = None, None
        try:  # what resume could not read is refused now, on every rank alike
            if env.is_main:
                main = checked(global_state([(m, o) for m, o in self.members if not m.per_rank]))
        except UserError as e:
            refused = str(e)
        ranks = gather_per_rank(self.members, env, refused)  # collective
        if main is not None:
            main.update(world_size=env.world_size, rng=ranks)
            path = save(main, self.output_dir, self.step, self.keep, name)
            log.info("checkpoint: %s", path)
        # Nobody races ahead and dies before the file is complete.
        barrier(env)

    def abandon(self) -> None:
        """A failed job's background save given up (DCPCheckpointer's async saves; every save
        here is written at once)."""

    def keep_as_best(self, step: int) -> None:
        """Rank 0: the checkpoint just saved at `step` is also checkpoints/best.pt: a hard link
        where the file system has them (no second copy on disk), else a copy."""
        if not self.env.is_main:
            return
        folder = checkpoint_dir(self.output_dir)
        source, tmp = folder / f"step_{step:08d}.pt", folder / f".best.pt.{os.getpid()}.tmp"
        tmp.unlink(missing_ok=True)
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copy2(source, tmp)
        os.replace(tmp, folder / "best.pt")

    def restore(self, path: Path) -> None:
        """Load the checkpoint at `path` into every member of this job (the position with its
        resume arithmetic, this rank's RNG): the wrapper's own format, else one line."""
        if is_sharded(path) != self.sharded:
            made_by, wrapper = (
                ("a ddp=fsdp2", "fsdp2") if is_sharded(path) else ("a DDP", "default")
            )
            raise UserError(
                f"{path} is a checkpoint of {made_by} run: resume it with ddp={wrapper}, or start "
                f"from its weights with trainer.init_from={path} and trainer.resume=never"
            )
        self._restore(Path(path))

    def _restore(self, path: Path) -> None:
        state.load_members(self.members, load(path), self.env, path)


# ---- the collectives of every save ----


def agree(objects: state.CheckpointedObjects, env: DistEnv) -> None:
    """`# collective`, first in every save: what each rank holds a copy of and updates on its
    own, the model's and the EMA's buffers (BatchNorm statistics), becomes rank 0's, so a
    checkpoint holds one rank's state and not a mix of them (distributed/ddp.py)."""
    sync_buffers([objects.model, *([objects.ema.module] if objects.ema is not None else [])], env)


def global_state(members: list[tuple[state.Member, Any]]) -> dict[str, Any]:
    """The state of `members` (the global ones of a checkpoint), flat ones merged in."""
    out: dict[str, Any] = {}
    for member, obj in members:
        if member.flat:
            out.update(obj.state_dict())
        else:
            out[member.name] = obj.state_dict()
    return out


def gather_per_rank(
    members: list[tuple[state.Member, Any]], env: DistEnv, refused: str | None = None
) -> list[Any]:
    """Collective: every rank's per-rank state, checked loadable, as the list `rng` holds;
    a state one rank cannot save (or `refused`: why this rank cannot save) is refused on every
    rank alike."""
    mine = global_state([(m, obj) for m, obj in members if m.per_rank])
    try:
        mine = checked(to_cpu(mine))
    except UserError as e:
        refused = str(e)
    ranks = all_gather_objects((mine, refused), env)
    refused = next((why for _, why in ranks if why), None)
    if refused is not None:
        raise UserError(refused)
    return [rank_state for rank_state, _ in ranks]


# ---- the file ----


def save(
    content: dict[str, Any], output_dir: Path, step: int, keep: int, name: str | None = None
) -> Path:
    """Write `content` as checkpoints/step_<step>.pt (or checkpoints/<name>, never rotated):
    temporary file, fsync, rename; then only the newest `keep` step files are kept.

    A process killed mid-write leaves only a *.tmp file behind; the previous checkpoint stays
    the newest complete one, and rename is atomic on POSIX file systems.
    """
    folder = checkpoint_dir(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(folder)
    final = folder / (name or f"step_{step:08d}.pt")
    tmp = folder / f".{final.name}.{os.getpid()}.tmp"
    try:
        write_synced(tmp, content)
        os.replace(tmp, final)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError
        too_large, failed = over_size_limit(e, tmp), write_failed(e, final, folder)
        remove_quietly(tmp)  # then: a full disk needs the space back (for errors/, the logs)
        if too_large:
            raise UserError(file_too_large(final)) from e
        raise failed from e
    fsync_dir(folder)
    if name is None:
        for _, old in [s for s in steps(folder) if s[1].suffix == ".pt"][:-keep]:
            old.unlink(missing_ok=True)
    return final


def write_synced(path: Path, content: Any) -> None:
    """`content` (bytes, or anything torch.save writes) in `path`, on disk when this returns."""
    with open(path, "wb") as f:
        if isinstance(content, bytes):
            f.write(content)
        else:
            torch.save(content, f)
        f.flush()
        os.fsync(f.fileno())


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


# ---- what a checkpoint may hold ----

# Held as they are: weights_only reads these (builtins by pickle opcode, the rest allowlisted).
_ATOMS = (type(None), bool, int, float, complex, str, bytes, bytearray)
_TORCH_ATOMS = (torch.Tensor, torch.dtype, torch.device, torch.Size)
_DICTS = (dict, collections.OrderedDict, collections.Counter)
_PLAIN = (bool, int, float, complex, str, bytes)
# A structure nested deeper than this is taken for a cycle.
_MAX_DEPTH = 200


class Unloadable(Exception):
    """A value weights_only would refuse: `where` is its key path, `kind` its type's name."""

    def __init__(self, where: str, kind: str) -> None:
        super().__init__(f"{where}: {kind}")
        self.where, self.kind = where, kind


def checked(content: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's members made `loadable`; a member that cannot be is one UserError naming
    it (for a callback: `callbacks.<name>` and the key in its state_dict)."""
    out: dict[str, Any] = {}
    for member, value in content.items():
        # The callbacks' states, by callback name: each is named on its own.
        parts = value.items() if member == "callbacks" else [(None, value)]
        made = {}
        for name, part in parts:
            try:
                made[name] = loadable(part)
            except Unloadable as e:
                owner = f"callbacks.{name}" if name is not None else f"the checkpoint's {member}"
                raise UserError(
                    f"{owner}: state_dict(){e.where} holds a {e.kind}, which "
                    "torch.load(weights_only=True) cannot read back, so no resume could load "
                    "this checkpoint: return tensors, numbers, strings, lists, tuples or dicts "
                    "from state_dict() (numpy values are converted)"
                ) from None
        out[member] = made if member == "callbacks" else made[None]
    return out


def loadable(value: Any, where: str = "", depth: int = 0) -> Any:
    """`value` with everything made a type weights_only reads; raises Unloadable (naming the
    key path from `where` on) for a value that has none."""
    if depth > _MAX_DEPTH:
        raise Unloadable(where, f"structure nested over {_MAX_DEPTH} deep (a cycle?)")
    if type(value) in _ATOMS or isinstance(value, _TORCH_ATOMS):
        return value
    if isinstance(value, np.generic):  # np.float64, np.int64, np.bool_, np.str_
        return loadable(value.item(), where, depth + 1)
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "biufc":
            return torch.from_numpy(np.array(value, copy=True, order="C"))
        return loadable(value.tolist(), where, depth + 1)
    if isinstance(value, _PLAIN):  # an IntEnum, a str subclass
        return next(t for t in _PLAIN if isinstance(value, t))(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, dict):
        items = [
            (loadable(k, f"{where}[{k!r}]", depth + 1), loadable(v, f"{where}[{k!r}]", depth + 1))
            for k, v in value.items()
        ]
        if type(value) in _DICTS and all(
            a is k and b is v for (a, b), (k, v) in zip(items, value.items())
        ):
            return value
        return dict(items)
    if isinstance(value, (list, tuple, set, frozenset)):
        seq = list(value)
        items = [loadable(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(seq)]
        # A namedtuple becomes a tuple, a frozenset a set (weights_only reads neither).
        plain_type = list if isinstance(value, list) else tuple if isinstance(value, tuple) else set
        if type(value) is plain_type and all(a is b for a, b in zip(items, seq)):
            return value
        return plain_type(items)
    kind = type(value)
    raise Unloadable(where, f"{kind.__module__}.{kind.__qualname__}")


def to_cpu(obj: Any) -> Any:
    """`obj` with its tensors on the CPU: a CUDA tensor pickled by rank 1 would be unpickled
    onto rank 1's GPU by rank 0's process."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj
