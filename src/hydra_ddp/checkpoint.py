"""Checkpoints: written by global rank 0 only, atomically, keeping the newest K.

A checkpoint holds everything a resumed run needs to continue exactly where it stopped: the
unwrapped model, optimizer, LR scheduler, grad scaler, the step and the sampler's position in
the epoch, and every rank's RNG state. It is read with `torch.load(weights_only=True)`, so a
file that would run code when unpickled is refused rather than executed.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from hydra_ddp.errors import UserError

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step_(\d{8})\.pt$")


def checkpoint_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def save(state: dict[str, Any], output_dir: Path, step: int, keep: int) -> Path:
    """Write `state` as checkpoints/step_<step>.pt: temporary file, fsync, rename.

    A process killed mid-write leaves only a *.tmp file behind; the previous checkpoint stays
    the newest complete one, and rename is atomic on POSIX file systems.
    """
    folder = checkpoint_dir(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step_{step:08d}.pt"
    tmp = folder / f".{final.name}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(folder)
    for old in sorted(_complete(folder))[:-keep]:
        old[1].unlink(missing_ok=True)
    return final


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _complete(folder: Path) -> list[tuple[int, Path]]:
    if not folder.is_dir():
        return []
    return [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]


def latest(output_dir: Path) -> Path | None:
    """The newest complete checkpoint in the job's output dir, if any."""
    found = sorted(_complete(checkpoint_dir(output_dir)))
    return found[-1][1] if found else None


def resolve_resume(resume: str, output_dir: Path) -> Path | None:
    """trainer.resume -> the file to load (None: start fresh)."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest(output_dir)
    path = Path(resume)
    if not path.is_file():
        raise UserError(f"trainer.resume={resume}: no such file; give a checkpoint path, "
                        "trainer.resume=auto (newest in the output dir) or never")
    return path


def load(path: Path, map_location: torch.device | str = "cpu") -> dict[str, Any]:
    """Read a checkpoint safely; every failure is one clear line naming the file."""
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UserError(f"refusing to load {path}: it holds objects that would run code when "
                        "unpickled (torch.load weights_only=True rejected it); only load "
                        "checkpoints you trust, re-saved as plain tensors") from e
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise UserError(f"{path} is not a readable checkpoint ({str(e).splitlines()[0]}): it "
                        "may be truncated or corrupt; point trainer.resume at another one, or "
                        "trainer.resume=never") from e
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise UserError(f"{path} is not a hydra-ddp checkpoint (no model/step entries)")
    return state


def load_model_state(model: torch.nn.Module, state: dict[str, Any], path: Path) -> None:
    """Load weights, turning a shape mismatch (a checkpoint of another model) into one line."""
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        detail = next((ln.strip() for ln in str(e).splitlines()
                       if "size mismatch" in ln or "Missing key" in ln or "Unexpected key" in ln),
                      str(e).splitlines()[0])
        raise UserError(f"{path} is a checkpoint of a different model ({detail}): resume with "
                        "the model config it was trained with, or trainer.resume=never") from e
