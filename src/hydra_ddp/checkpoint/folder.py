"""A run's checkpoints/ folder: which checkpoint a run resumes from (`resolve_resume`, for
trainer.resume) or evaluates as its best (`best`), and the folder before a run writes into it
(`check_folder`; `set_aside_checkpoints` when it starts over). What a file or folder in it holds,
and whether it is whole, is reader.py's."""

from __future__ import annotations

import logging
from pathlib import Path

from hydra_ddp.checkpoint.reader import SUFFIX, checkpoint_dir, damage, latest, named
from hydra_ddp.errors import UserError

log = logging.getLogger(__name__)


def resolve_resume(resume: str, output_dir: Path) -> Path | None:
    """trainer.resume -> the checkpoint to load (None: start fresh).

    auto: the newest intact checkpoint in this job's output dir, or a fresh start when it has
    none; never: a fresh start; a file or folder: that checkpoint; a run dir (or its
    checkpoints/): the newest intact checkpoint in it.
    """
    if resume == "never":
        return None
    if resume == "auto":
        return latest(output_dir)
    return named(resume, "trainer.resume")


def best(output_dir: Path) -> Path | None:
    """The run's best checkpoint: best.pt, or a ddp=fsdp2 run's best.dcp (also when a
    replacement of it was killed half-way: `left_by_swap`); None when it has none."""
    folder = checkpoint_dir(output_dir)
    if (folder / "best.pt").exists():
        return folder / "best.pt"
    final = folder / f"best{SUFFIX}"
    return final if final.is_dir() else left_by_swap(final)


def left_by_swap(final: Path) -> Path | None:
    """When the folder `final` is missing, the whole one that a replacement of it (dcp.py's
    `_swap_into_place`) killed between its two renames left: the new one (.<name>.tmp, whole
    once its manifest is written) before the old one (.<name>.old). A step's whole .tmp with
    no .old beside it is a save killed before its rename (it never had the name): not one."""
    tmp, old = final.with_name(f".{final.name}.tmp"), final.with_name(f".{final.name}.old")
    if final.exists() or not (old.is_dir() or final.name == f"best{SUFFIX}"):
        return None
    return next((p for p in (tmp, old) if p.is_dir() and damage(p) is None), None)


def check_folder(output_dir: Path) -> None:
    """Refuse a job whose checkpoints/ cannot be a folder, before it trains for nothing."""
    folder = checkpoint_dir(output_dir)
    if folder.exists() and not folder.is_dir():
        raise UserError(
            f"{folder} exists but is not a directory, so no checkpoint could be "
            "saved: move it away, or choose another hydra.run.dir"
        )


def set_aside_checkpoints(output_dir: Path) -> Path | None:
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
