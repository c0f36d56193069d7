"""A run's checkpoints/ folder: which checkpoint a run resumes from (`resolve_resume`, for
trainer.resume), which one eval and export read (`pick`, `read_picked`, for ckpt=), its best
(`best`), and the folder before a run writes into it (`check_folder`; `set_aside_checkpoints`
when it starts over). What a file or folder in it holds, and whether it is whole, is
reader.py's."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra_ddp.checkpoint.reader import (
    SUFFIX,
    checkpoint_dir,
    latest,
    load,
    named,
    refuse,
    steps,
    why_not_whole,
)
from hydra_ddp.errors import UserError

log = logging.getLogger(__name__)


def resolve_resume(resume: str, output_dir: Path) -> Path | None:
    """trainer.resume -> the checkpoint to load (None: start fresh).

    auto: the newest intact checkpoint in this job's output dir, or a fresh start when it has
    none (refused when it has only damaged ones: a fresh start would rotate them away); never:
    a fresh start; a file or folder: that checkpoint; a run dir (or its checkpoints/): the
    newest intact checkpoint in it.
    """
    if resume == "never":
        return None
    if resume != "auto":
        return named(resume, "trainer.resume")
    found, damaged = latest(output_dir), [p for _, p in steps(checkpoint_dir(output_dir))]
    if found is None and damaged:
        raise refuse(
            f"trainer.resume=auto: no checkpoint in {checkpoint_dir(output_dir)} is intact "
            f"({damaged[-1].name}: {why_not_whole(damaged[-1])}), and a fresh start would replace "
            "them (trainer.resume=never moves them to checkpoints.before-<n>/)",
            "trainer.resume",
        )
    return found


def best(output_dir: Path) -> Path | None:
    """The run's best checkpoint: best.pt, or a ddp=fsdp2 run's best.dcp (also when a
    replacement of it was killed half-way: `left_by_swap`); None when it has none."""
    folder = checkpoint_dir(output_dir)
    if (folder / "best.pt").exists():
        return folder / "best.pt"
    final = folder / f"best{SUFFIX}"
    return final if final.is_dir() else left_by_swap(final)


def pick(run: Path, ckpt: str) -> Path:
    """What eval's and export's `ckpt=` names in `run`: last (its newest intact checkpoint),
    best, or a checkpoint or run dir of its own (reader.named)."""
    found = latest(run) if ckpt == "last" else best(run) if ckpt == "best" else named(ckpt, "ckpt")
    if found is None:
        raise UserError(
            f"run={run} holds no {'best' if ckpt == 'best' else 'intact'} checkpoint "
            "(checkpoints/step_*, best.*): give ckpt=<a checkpoint or run dir>"
        )
    return found


def read_picked(run: Path, ckpt: str) -> tuple[Path, dict[str, Any]]:
    """The checkpoint `ckpt=` picks in `run`, and its state (reader.load). A run resuming in
    `run` rotates its checkpoints (trainer.keep_ckpts), and may remove the newest between its
    pick and its read: then last and best are picked again, so both jobs go on correctly."""
    path = pick(run, ckpt)
    while True:
        try:
            return path, load(path, key="ckpt")
        except UserError:
            newer = pick(run, ckpt) if ckpt in ("last", "best") else path
            if newer == path:
                raise
            path = newer


def left_by_swap(final: Path) -> Path | None:
    """When the folder `final` is missing, the whole one that a replacement of it (dcp.py's
    `_swap_into_place`) killed between its two renames left: the new one (.<name>.tmp, whole
    once its manifest is written) before the old one (.<name>.old). A step's whole .tmp with
    no .old beside it is a save killed before its rename (it never had the name): not one."""
    tmp, old = final.with_name(f".{final.name}.tmp"), final.with_name(f".{final.name}.old")
    if final.exists() or not (old.is_dir() or final.name == f"best{SUFFIX}"):
        return None
    return next((p for p in (tmp, old) if p.is_dir() and why_not_whole(p) is None), None)


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
