"""Reading a checkpoint: which one `trainer.resume` / `trainer.init_from` names, read safely
(`torch.load(weights_only=True)`, every failure one line naming the file and the key), and
its weights loaded into a model on resume. (`trainer.init_from`'s other formats: weights.py.)"""

from __future__ import annotations

import logging
import pickle
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from hydra_ddp.checkpoint import dcp_files
from hydra_ddp.checkpoint.files import checkpoint_damage, latest
from hydra_ddp.disk import check_archive
from hydra_ddp.errors import UserError, first_line
from hydra_ddp.export_format import CONFIG, read_state

log = logging.getLogger(__name__)


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
    checkpoint folder (ddp=fsdp2) is read whole: its model (and EMA) and step; so is an export
    folder (its model and step)."""
    path = Path(path)
    if path.is_dir() and (path / CONFIG).is_file():  # python -m hydra_ddp.export's folder
        return read_state(path)
    if path.is_dir():
        return dcp_files.load_full(path)
    state = read_archive(path, key, map_location)
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise UserError(
            f"{path} is not a hydra-ddp checkpoint (no model/step entries): give "
            f"a file from <output dir>/checkpoints/; {another(key)}"
        )
    return state


def another(key: str) -> str:
    """What to do instead, for the setting `key` that named an unreadable checkpoint."""
    if key == "ckpt":  # hydra_ddp.eval's and hydra_ddp.export's
        return "give another ckpt=<file>, or ckpt=last or ckpt=best"
    otherwise = f"{key}=never" if key == "trainer.resume" else f"no {key}"
    return f"point {key} at another one, or {otherwise}"


def read_archive(path: Path, key: str, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """What a torch.save file holds, read with `torch.load(weights_only=True)` (`mmap`: tensors
    read from the file when used); every failure is one line naming the file and `key`."""
    path = Path(path)
    point = another(key)
    check_archive(path, key)  # a FIFO, a text file, random bytes: one line each
    if path.is_file() and path.stat().st_size == 0:
        raise UserError(f"{path} is empty (a checkpoint whose write never completed?): {point}")
    why = checkpoint_damage(path) if zipfile.is_zipfile(path) else None
    if why is not None:
        raise UserError(f"{path} is not a readable checkpoint ({why}): {point}")
    try:
        with warnings.catch_warnings():
            # e.g. "Detected pickle protocol 4": noise next to the one-line error below.
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
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
            f"{path} is not a readable checkpoint (not a torch.save archive, or corrupt): {point}"
        ) from e
    except (RuntimeError, EOFError, OSError, ValueError, IndexError, KeyError) as e:
        raise UserError(
            f"{path} is not a readable checkpoint ({first_line(e, 160)}): it may be "
            f"truncated or corrupt; {point}"
        ) from e


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
