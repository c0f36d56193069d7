"""Checkpoints: written by global rank 0 only, atomically, keeping the newest K.

A checkpoint holds everything a resumed run needs to continue exactly where it stopped: the
unwrapped model, optimizer, LR scheduler, grad scaler, the step and the sampler's position in
the epoch, and every rank's RNG state; made plain at save (safe_state.py), so that
`torch.load(weights_only=True)`, which refuses files that would run code, reads it back.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import re
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from hydra_ddp.checkpoint import dcp_files, safe_state
from hydra_ddp.dist import DistEnv, all_gather_objects, barrier
from hydra_ddp.errors import UserError, check_archive, file_too_large, first_line, over_size_limit

log = logging.getLogger(__name__)

# step_<step>.pt files; step_<step>.dcp folders are ddp=fsdp2's sharded checkpoints (dcp.py).
_NAME = re.compile(r"^step_(\d{8})\.(?:pt|dcp)$")
_TMP = re.compile(r"^\.step_\d{8}\.pt\.(\d+)\.tmp$")


def checkpoint_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def save(
    state: dict[str, Any], output_dir: Path, step: int, keep: int, name: str | None = None
) -> Path:
    """Write `state` as checkpoints/step_<step>.pt (or checkpoints/<name>, never rotated):
    temporary file, fsync, rename.

    A process killed mid-write leaves only a *.tmp file behind; the previous checkpoint stays
    the newest complete one, and rename is atomic on POSIX file systems.
    """
    folder = checkpoint_dir(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(folder)
    final = folder / (name or f"step_{step:08d}.pt")
    tmp = folder / f".{final.name}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError
        too_large = over_size_limit(e, tmp)
        tmp.unlink(missing_ok=True)
        if too_large:
            raise UserError(file_too_large(final)) from e
        raise UserError(
            f"could not write checkpoint {final} ({write_error(e, folder)}): free space or "
            "quota there, or resume in another dir; the checkpoints already there are intact"
        ) from e
    _fsync_dir(folder)
    if name is None:
        for old in sorted(c for c in _complete(folder) if c[1].suffix == ".pt")[:-keep]:
            old[1].unlink(missing_ok=True)
    return final


def keep_as_best(output_dir: Path, step: int) -> None:
    """Make step <step>'s checkpoint also checkpoints/best.pt: a hard link where the file
    system has them (no second copy on disk), else a copy. Rank 0 only."""
    folder = checkpoint_dir(output_dir)
    source, tmp = folder / f"step_{step:08d}.pt", folder / f".best.pt.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copy2(source, tmp)
    os.replace(tmp, folder / "best.pt")


def write_error(e: BaseException, folder: Path) -> str:
    """Why a write under `folder` failed, in a few words (torch.save's message names no
    cause, so a full disk is told from the free space left)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    try:
        if shutil.disk_usage(folder).free < 1 << 20:
            return "No space left on device"
    except OSError:
        pass
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale_tmp(folder: Path) -> None:
    """Delete temporary files left by writers that were killed mid-write (their pid is gone).
    Only global rank 0 ever writes here, so a live pid other than ours is not expected."""
    for p in folder.iterdir():
        m = _TMP.match(p.name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            p.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _complete(folder: Path) -> list[tuple[int, Path]]:
    if not folder.is_dir():
        return []
    return [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]


def damage(path: Path) -> str | None:
    """Why a file is not a whole, intact torch.save archive, or None when it is.

    torch.save writes a zip whose members each carry a CRC-32: checking every member finds
    bytes flipped anywhere (a bad disk, a partial copy), not only a missing end record. It
    reads the whole file, so the answer is kept for as long as the file is unchanged: picking
    the newest checkpoint and then loading it check it once."""
    if path.is_dir():
        return dcp_files.damage(path)
    try:
        st = path.stat()
    except OSError as e:
        return f"unreadable ({first_line(e, 160)})"
    return _damage(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _damage(path: str, size: int, mtime_ns: int) -> str | None:
    try:
        if not zipfile.is_zipfile(path):
            return "not a complete zip archive (truncated?)"
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
        return None if bad is None else f"member {bad} fails its CRC check (corrupt)"
    except (OSError, zipfile.BadZipFile, EOFError, ValueError) as e:
        return f"unreadable ({first_line(e, 160)})"


def latest(output_dir: Path) -> Path | None:
    """The newest intact checkpoint in the job's output dir, if any. A step file that is
    truncated or corrupt is skipped with a warning, and the one before it is used."""
    for _, path in sorted(_complete(checkpoint_dir(output_dir)), reverse=True):
        why = damage(path)
        if why is None:
            return path
        log.warning("skipping %s: %s; trying the previous checkpoint", path, why)
    return None


def check_folder(output_dir: Path) -> None:
    """Refuse a job whose checkpoints/ cannot be a folder, before it trains for nothing."""
    folder = checkpoint_dir(output_dir)
    if folder.exists() and not folder.is_dir():
        raise UserError(
            f"{folder} exists but is not a directory, so no checkpoint could be "
            "saved: move it away, or choose another hydra.run.dir"
        )


def set_aside(output_dir: Path) -> Path | None:
    """trainer.resume=never in a dir that holds checkpoints: move them to
    checkpoints.before-<n>/ (nothing made earlier is deleted), so the new run's rotation and a
    later resume see only its own. Rank 0, before any checkpoint is written."""
    folder = checkpoint_dir(output_dir)
    if not folder.is_dir() or not any(folder.iterdir()):
        return None
    n = 1
    while (aside := folder.with_name(f"checkpoints.before-{n}")).exists():
        n += 1
    folder.rename(aside)
    log.warning(
        "trainer.resume=never: the checkpoints already in %s were moved to %s", folder, aside
    )
    return aside


def resolve_resume(resume: str, output_dir: Path) -> Path | None:
    """trainer.resume -> the file to load (None: start fresh).

    auto: the newest complete checkpoint in this job's output dir, or a fresh start when it
    has none; never: a fresh start; a file: that checkpoint; a directory: the newest
    checkpoint in it (a job's output dir or its checkpoints/ folder).
    """
    if resume == "never":
        return None
    if resume == "auto":
        return latest(output_dir)
    return file_or_newest(resume, "trainer.resume", "trainer.resume=never to start fresh")


def file_or_newest(value: str, key: str, otherwise: str) -> Path:
    """The checkpoint that `key=value` names: a file, or the newest complete one of a run dir
    (or of its checkpoints/ folder)."""
    path = Path(value)
    if path.is_dir() and path.suffix == ".dcp":  # a sharded checkpoint (ddp=fsdp2) itself
        return path
    if path.is_dir():
        found = latest(path.parent if path.name == "checkpoints" else path)
        if found is None:
            raise UserError(
                f"{key}={value}: the directory holds no complete checkpoint "
                f"(checkpoints/step_*.pt); give a checkpoint file, or {otherwise}"
            )
        return found
    check_archive(path, key)
    if not path.is_file():
        raise UserError(
            f"{key}={value}: no such file; give a checkpoint file (<run dir>/checkpoints/"
            f"step_*.pt or best.pt) or a run dir, or {otherwise}"
        )
    return path


def load(path: Path, map_location: Any = "cpu", key: str = "trainer.resume") -> dict[str, Any]:
    """Read a checkpoint safely; every failure is one line naming the file and `key`. A sharded
    checkpoint folder (ddp=fsdp2) is read whole: its model (and EMA) and step."""
    path = Path(path)
    if path.is_dir():
        return dcp_files.load_full(path)
    check_archive(path, key)  # a FIFO, a text file, random bytes: one line each
    if path.is_file() and path.stat().st_size == 0:
        raise UserError(
            f"{path} is empty (a checkpoint whose write never completed?): point "
            "trainer.resume at another one, or trainer.resume=never"
        )
    why = damage(path) if zipfile.is_zipfile(path) else None
    if why is not None:
        raise UserError(
            f"{path} is not a readable checkpoint ({why}): point trainer.resume at "
            "another one, or trainer.resume=never"
        )
    try:
        with warnings.catch_warnings():
            # e.g. "Detected pickle protocol 4": noise next to the one-line error below.
            warnings.simplefilter("ignore", UserWarning)
            state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        # weights_only names a forbidden global ("unsupported GLOBAL posix.system") when the
        # file asks to import and call code; any other unpickling failure means bad bytes.
        banned = next((ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln.upper()), None)
        if banned is not None:
            raise UserError(
                f"refusing to load {path}: it holds objects that would run code "
                f"when unpickled ({banned}); torch.load(weights_only=True) rejected "
                "it. Only load checkpoints you trust, re-saved as plain tensors"
            ) from e
        raise UserError(
            f"{path} is not a readable checkpoint (not a torch.save archive, or "
            "corrupt): point trainer.resume at another one, or "
            "trainer.resume=never"
        ) from e
    except (RuntimeError, EOFError, OSError, ValueError, IndexError, KeyError) as e:
        raise UserError(
            f"{path} is not a readable checkpoint ({first_line(e, 160)}): it may be "
            "truncated or corrupt; point trainer.resume at another one, or "
            "trainer.resume=never"
        ) from e
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise UserError(
            f"{path} is not a hydra-ddp checkpoint (no model/step entries): give "
            "a file from <output dir>/checkpoints/, or trainer.resume=never"
        )
    return state


def load_model_state(
    model: torch.nn.Module, state: dict[str, Any], path: Path, hint: str = "or trainer.resume=never"
) -> None:
    """Load weights, turning a shape mismatch (a checkpoint of another model) into one line."""
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        detail = next(
            (
                ln.strip()
                for ln in str(e).splitlines()
                if "size mismatch" in ln or "Missing key" in ln or "Unexpected key" in ln
            ),
            str(e).splitlines()[0],
        )
        raise UserError(
            f"{path} is a checkpoint of a different model ({detail[:300]}): resume with "
            f"the model config it was trained with (its run's .hydra/config.yaml), {hint}"
        ) from e


def init_weights(model: torch.nn.Module, source: str, strict: bool) -> Path:
    """trainer.init_from: load the model weights of a checkpoint file, or of the newest one in
    a run dir, into `model`; nothing else. With `strict` false, only the tensors whose names and
    shapes match, and one line each for the rest. Returns the file read."""
    path = file_or_newest(source, "trainer.init_from", "no trainer.init_from")
    state = load(path, key="trainer.init_from")
    if strict:
        load_model_state(model, state, path, hint="or trainer.init_strict=false")
        return path
    saved, mine = state["model"], model.state_dict()
    fits = {k: v for k, v in saved.items() if k in mine and mine[k].shape == v.shape}
    model.load_state_dict(fits, strict=False)
    reshaped = sorted(k for k in saved if k in mine and k not in fits)
    for what, keys in (
        ("not in the checkpoint (kept as initialised)", sorted(set(mine) - set(saved))),
        ("in the checkpoint only (unused)", sorted(set(saved) - set(mine))),
        ("of another shape (kept as initialised)", reshaped),
    ):
        if keys:
            log.warning("trainer.init_from: %d tensor(s) %s: %s", len(keys), what, ", ".join(keys))
    log.info("trainer.init_from: %d of %d tensors loaded from %s", len(fits), len(mine), path)
    return path


# State a run may add to its checkpoints later on (trainer.ema_decay, the monitor's best score,
# a callback, a comm hook's state).
OPTIONAL_STATE = ("ema", "monitor", "callbacks", "comm_hook")


class Checkpointer:
    """The training state on disk: `maybe_save` every trainer.ckpt_interval steps, `save` at
    the end or on a stop signal, `restore` on resume.

    `stateful` are the objects with state_dict/load_state_dict saved by rank 0 (model, scaler,
    EMA, monitor, callbacks; `optimizer` is an optim.Optimizers, saved as the optimizer and
    scheduler states); `per_rank` are those whose state
    differs between ranks (a comm hook's error feedback), gathered into the same file next to
    every rank's RNG state. Saving and restoring are collective: every rank calls them.
    """

    def __init__(
        self,
        output_dir: Path,
        env: DistEnv,
        interval: int,
        keep: int,
        total_steps: int,
        stateful: dict[str, Any],
        per_rank: dict[str, Any] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        """`meta`: saved in every checkpoint next to the position (the batch size)."""
        self.output_dir, self.env = Path(output_dir), env
        self.meta = dict(meta or {})
        self.interval, self.keep, self.total_steps = interval, keep, total_steps
        self.stateful, self.per_rank = stateful, per_rank or {}

    def due(self, step: int) -> bool:
        """Every `interval` steps (0: never); the end of the run saves anyway."""
        return bool(self.interval) and step % self.interval == 0 and step < self.total_steps

    def maybe_save(self, position: dict[str, int]) -> None:
        """Collective."""
        if self.due(position["step"]):
            self.save(position)

    def save(self, position: dict[str, int], name: str | None = None) -> None:
        """Collective: gather every rank's RNG (and per-rank) state, then global rank 0 alone
        writes checkpoints/step_<step>.pt, or checkpoints/<name> (the best one, never rotated).
        """
        env = self.env
        mine: dict[str, Any] = {"torch": torch.get_rng_state()}
        if env.device.type == "cuda":
            mine["cuda"] = torch.cuda.get_rng_state(env.device)
        mine.update({k: safe_state.to_cpu(obj.state_dict()) for k, obj in self.per_rank.items()})
        state, refused = None, None
        try:  # what resume could not read is refused now, on every rank alike
            mine = safe_state.checked(mine)
            state = self._main_state() if env.is_main else None
        except UserError as e:
            refused = str(e)
        ranks = all_gather_objects((mine, refused), env)
        refused = next((why for _, why in ranks if why), None)
        if refused is not None:
            raise UserError(refused)
        if state is not None:
            state.update(
                self.meta, **position, world_size=env.world_size, rng=[r for r, _ in ranks]
            )
            path = save(state, self.output_dir, position["step"], self.keep, name)
            log.info("checkpoint: %s", path)
        # Nobody races ahead and dies before the file is complete.
        barrier(env)

    def _main_state(self) -> dict[str, Any]:
        """Rank 0: every stateful member's state, made loadable (safe_state.checked)."""
        state = {key: obj.state_dict() for key, obj in self.stateful.items()}
        if "optimizer" in self.stateful:
            state["scheduler"] = self.stateful["optimizer"].scheduler_state()
        return safe_state.checked(state)

    def keep_as_best(self, step: int) -> None:
        """Rank 0: the checkpoint just saved at `step` is also checkpoints/best.pt."""
        if self.env.is_main:
            keep_as_best(self.output_dir, step)

    def restore(self, path: Path, position_keys: list[str]) -> dict[str, Any]:
        """Load `path` into every stateful object and this rank's RNG; return the position, with
        the world size, batch size and sampler settings it was counted in (`saved_world_size`,
        `saved_batch_size`, `saved_sampler`; 0 or None: not recorded)."""
        env = self.env
        if Path(path).is_dir():
            raise UserError(
                f"{path} is a sharded checkpoint of a ddp=fsdp2 run: resume it with ddp=fsdp2, "
                f"or start from its weights with trainer.init_from={path} and "
                "trainer.resume=never"
            )
        state = load(path)
        load_model_state(self.stateful["model"], state, path)
        try:
            for key, obj in self.stateful.items():
                if key == "model":
                    continue
                if key == "optimizer":  # optim.Optimizers: the optimizers and their schedules
                    obj.load(state["optimizer"], state["scheduler"], path)
                    continue
                if key in OPTIONAL_STATE and key not in state:
                    # A checkpoint from before the feature was switched on: it starts fresh.
                    log.warning("%s holds no %s state: starting it fresh", path, key)
                    continue
                obj.load_state_dict(state[key])
            position: dict[str, Any] = {k: int(state.get(k, 0)) for k in position_keys}
            position["step"] = int(state["step"])
        except (KeyError, ValueError, RuntimeError, TypeError) as e:
            raise UserError(
                f"{path} does not match this job's optimizer/scheduler setup "
                f"({type(e).__name__}: {first_line(e)}): resume with the optim.* and "
                "scheduler.* config it was trained with, or trainer.resume=never"
            ) from e
        position.update(counted_in(state, env))
        ranks = state.get("rng") or []
        same_world = position["saved_world_size"] == env.world_size
        mine = ranks[env.rank] if env.rank < len(ranks) and same_world else {}
        restore_rng(ranks, env)
        for key, obj in self.per_rank.items():
            if key in mine:
                obj.load_state_dict(mine[key])
            else:
                log.warning(
                    "%s holds no %s state for rank %d: starting it fresh", path, key, env.rank
                )
        return position


def counted_in(state: dict[str, Any], env: DistEnv) -> dict[str, Any]:
    """How a checkpoint's data position was counted (rows = batch_in_epoch x batch_size x
    world size, in its sampler's order): `saved_world_size`, `saved_batch_size` (0: not
    recorded, this job's) and `saved_sampler` (epoch_rows.settings; None: not recorded)."""
    return {
        "saved_world_size": int(state.get("world_size") or env.world_size),
        "saved_batch_size": int(state.get("batch_size", 0)),
        "saved_sampler": state.get("sampler"),
    }


def restore_rng(ranks: list[dict[str, Any]], env: DistEnv) -> None:
    """This rank's RNG states as the checkpoint saved them (none when it had fewer ranks)."""
    if env.rank < len(ranks):
        torch.set_rng_state(ranks[env.rank]["torch"].cpu())
        if env.device.type == "cuda" and "cuda" in ranks[env.rank]:
            torch.cuda.set_rng_state(ranks[env.rank]["cuda"].cpu(), env.device)
