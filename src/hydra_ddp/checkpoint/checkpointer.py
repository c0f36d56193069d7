"""Writing checkpoints: `Checkpointer` (a DDP run's checkpoints/step_<step>.pt, written by
global rank 0, atomically, the newest K kept; dcp.py's subclass writes ddp=fsdp2's folders),
and what any checkpoint may hold.

Resume and evaluation read checkpoints with `torch.load(weights_only=True)`, which refuses any
object whose class it does not know, so state is made plain at save (`loadable`): numpy values
become numbers and tensors, a namedtuple a tuple, a path a string; anything else (a user's
class, an Enum) is refused at save, in one line naming where it is, rather than found at
resume when the run can no longer be continued.
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

# What `save` and `keep_as_best` write before the rename, with the writer's pid.
_TMP = re.compile(r"^\.(?:step_\d{8}|best)\.pt\.(\d+)\.tmp$")


class Checkpointer:
    """The training state on disk: `maybe_save` every trainer.ckpt_interval steps, `save` at
    the end or on a stop signal, `restore` on resume; all collective. Rank 0 saves the global
    members, with every rank's per-rank ones gathered into the same file."""

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
        async_save: bool = False,  # trainer.async_ckpt: only ddp=fsdp2's folders are
    ) -> None:
        self.output_dir, self.env, self.objects = Path(output_dir), env, objects
        self.interval, self.keep, self.total_steps = interval, keep, total_steps
        self.async_save = async_save
        held = ((m, m.get(objects)) for m in members)
        self.members = [(m, obj) for m, obj in held if obj is not None]

    @property
    def step(self) -> int:
        position = self.objects.position
        return int(position.pos.step) if position is not None else 0

    def due(self, step: int) -> bool:
        return bool(self.interval) and step % self.interval == 0 and step < self.total_steps

    def maybe_save(self) -> None:
        if self.due(self.step):
            self.save(background=self.async_save)

    def save(self, name: str | None = None, background: bool = False) -> None:
        """Collective: checkpoints/step_<step>.pt, or checkpoints/<name> (best.pt). Rank 0 holds
        the global state; every rank's per-rank state is gathered into the same file."""
        self.wait()
        # collective: the buffers each rank updates on its own (BatchNorm statistics) become
        # rank 0's, so a checkpoint holds one rank's state
        ema = [self.objects.ema.module] if self.objects.ema is not None else []
        sync_buffers([self.objects.model, *ema], self.env)
        main, mine, refused = None, None, None
        try:  # what resume could not read is refused now, on every rank alike
            if self.env.is_main:
                main = checked(state_of([(m, o) for m, o in self.members if self._main(m)]))
            mine = checked(to_cpu(state_of([(m, o) for m, o in self.members if m.per_rank])))
        except UserError as e:
            refused = str(e)
        ranks = all_gather_objects((mine, refused), self.env)  # collective
        refused = next((why for _, why in ranks if why), None)
        if refused is not None:
            raise UserError(refused)
        if main is not None:
            main.update(world_size=self.env.world_size, rng=[rank for rank, _ in ranks])
        self._write(main, name, background)

    def _main(self, member: state.Member) -> bool:
        """A member that rank 0 writes."""
        return not member.per_rank

    def _write(self, main: dict[str, Any] | None, name: str | None, background: bool) -> None:
        if main is not None:
            log.info("checkpoint: %s", save(main, self.output_dir, self.step, self.keep, name))
        barrier(self.env)  # nobody races ahead and dies before the file is complete

    def wait(self) -> None:
        """Complete a background save (every save here is written at once)."""

    def abandon(self) -> None:
        """A failed job's background save given up."""

    def keep_as_best(self, step: int) -> None:
        """Rank 0: the checkpoint of `step` is also best.pt."""
        if not self.env.is_main:
            return
        folder = checkpoint_dir(self.output_dir)
        tmp = folder / f".best.pt.{os.getpid()}.tmp"
        tmp.unlink(missing_ok=True)
        link_or_copy(folder / f"step_{step:08d}.pt", tmp)
        os.replace(tmp, folder / "best.pt")

    def restore(self, path: Path) -> None:
        """Load the checkpoint at `path` (the wrapper's own format) into every member."""
        if is_sharded(path) != self.sharded:
            made_by, wrapper = (
                ("a ddp=fsdp2", "fsdp2") if is_sharded(path) else ("a DDP", "default")
            )
            raise UserError(
                f"{path} is a checkpoint of {made_by} run: resume it with ddp={wrapper}, or start "
                f"a run from its weights in a new dir: trainer.init_from={path} "
                "hydra.run.dir=<a new dir>"
            )
        self._restore(Path(path))

    def _restore(self, path: Path) -> None:
        state.load_members(self.members, load(path), self.env, path)


def state_of(members: list[tuple[state.Member, Any]]) -> dict[str, Any]:
    """The state of `members`, flat ones merged in."""
    out: dict[str, Any] = {}
    for member, obj in members:
        if member.flat:
            out.update(obj.state_dict())
        else:
            out[member.name] = obj.state_dict()
    return out


# ---- the file ----


def save(
    content: dict[str, Any], output_dir: Path, step: int, keep: int, name: str | None = None
) -> Path:
    """Write `content` as checkpoints/step_<step>.pt (or <name>, never rotated): temporary
    file, fsync, rename (a kill mid-write leaves only a *.tmp); then the newest `keep` kept."""
    folder = checkpoint_dir(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    # Only rank 0 of the job holding the run dir writes here: another pid's file is a dead
    # writer's.
    for p in folder.iterdir():
        m = _TMP.match(p.name)
        if m and int(m.group(1)) != os.getpid():
            p.unlink(missing_ok=True)
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
        rotate(folder, ".pt", keep)
    return final


def rotate(folder: Path, suffix: str, keep: int) -> None:
    """Only the newest `keep` step checkpoints of `suffix` (files or folders) are kept."""
    for _, old in [s for s in steps(folder) if s[1].suffix == suffix][:-keep]:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def write_synced(path: Path, content: Any) -> None:
    """`content` (bytes, or for torch.save) in `path`, on disk when this returns."""
    with open(path, "wb") as f:
        if isinstance(content, bytes):
            f.write(content)
        else:
            torch.save(content, f)
        f.flush()
        os.fsync(f.fileno())


def link_or_copy(source: Path, target: Path) -> None:
    """A hard link where the file system has them (no second copy on disk), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def swap_into_place(tmp: Path, final: Path) -> None:
    """Rename the whole folder `tmp` to `final`. A rename cannot replace a folder that holds
    files, so an old `final` is moved aside first and deleted once the new one is in place: a
    kill between the renames leaves both whole (for best.dcp, reader.left_by_swap finds the
    newest)."""
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)  # an earlier swap's, killed after its renames
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- what a checkpoint may hold ----

# Held as they are: weights_only reads these (builtins by pickle opcode, the rest allowlisted).
_ATOMS = (type(None), bool, int, float, complex, str, bytes, bytearray)
_TORCH_ATOMS = (torch.Tensor, torch.dtype, torch.device, torch.Size)
_DICTS = (dict, collections.OrderedDict, collections.Counter)
_PLAIN = (bool, int, float, complex, str, bytes)
# A structure nested deeper than this is taken for a cycle.
_MAX_DEPTH = 200


class Unloadable(Exception):
    def __init__(self, where: str, kind: str) -> None:
        super().__init__(f"{where}: {kind}")
        self.where, self.kind = where, kind


def checked(content: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's members made `loadable`, or one UserError naming the member."""
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
    """`value` made of types weights_only reads; containers in which nothing changes are kept
    as they are (a model's state_dict keeps its `_metadata`)."""
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
    """`obj` with its tensors on the CPU: rank 0 would unpickle rank 1's CUDA tensor onto
    rank 1's GPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj
