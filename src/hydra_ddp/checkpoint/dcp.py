"""ddp=fsdp2's checkpoints: a folder, checkpoints/step_<step>.dcp/ (best.dcp/ for the best),
written by every rank through torch.distributed.checkpoint:

    __<rank>_0.distcp  each rank's shards of the model, optimizer and EMA tensors (DCP's files)
    .metadata          DCP's index: which file holds which part of which tensor
    extra.pt           rank 0: position, schedules, scaler, monitor; every rank's RNG, callbacks
    manifest.json      written last: every other file's size and CRC-32

Atomic as the single files: every rank writes into checkpoints/.<name>.tmp/, and rank 0
renames it once all have finished and the manifest is written. DCP reshards the model and the
optimizer on load, and the position is kept in rows, so a run resumes on another number of
ranks.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from hydra_ddp.checkpoint import state
from hydra_ddp.checkpoint.checkpointer import (
    Checkpointer,
    fsync_dir,
    link_or_copy,
    rotate,
    swap_into_place,
    write_synced,
)
from hydra_ddp.checkpoint.reader import (
    EXTRA,
    MANIFEST,
    SUFFIX,
    check_whole,
    checkpoint_dir,
    crc32,
    left_by_swap,
    read_archive,
)
from hydra_ddp.disk import remove_quietly, write_failed
from hydra_ddp.distributed import all_gather_objects, barrier
from hydra_ddp.errors import UserError, first_line

log = logging.getLogger(__name__)

# How long a failed job waits for its background save's writer before removing its files.
_ABANDON_WAIT_S = 30.0


class DCPCheckpointer(Checkpointer):
    """Checkpointer's interface, with sharded folders. `async_save` (trainer.async_ckpt): the
    periodic saves are written in the background and completed before the next save; the
    end-of-run, best and stop-signal saves at once. Every method is collective."""

    sharded = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: tuple[Any, Path, Path, str | None] | None = None
        # The background save's collectives on a group of their own: on the training group
        # they could interleave with the step's all-gathers (torchtitan does the same).
        self._group = None
        if self.async_save and self.env.distributed:
            self._group = dist.new_group(backend="gloo")  # collective

    def _main(self, member: state.Member) -> bool:
        return not (member.per_rank or member.sharded)

    def _write(self, main: dict[str, Any] | None, name: str | None, background: bool) -> None:
        """step_<step>.dcp (best.dcp for name=best.pt), with `main` in extra.pt."""
        folder = checkpoint_dir(self.output_dir)
        final = folder / (
            f"step_{self.step:08d}{SUFFIX}" if name is None else name.removesuffix(".pt") + SUFFIX
        )
        tmp = folder / f".{final.name}.tmp"
        if main is not None:
            self._start_folder(folder, tmp)
            try:
                write_synced(tmp / EXTRA, main)
            except (OSError, RuntimeError) as e:
                shutil.rmtree(tmp, ignore_errors=True)
                raise write_failed(e, tmp) from e
        barrier(self.env)  # the fresh tmp folder exists before any rank writes into it
        shards = self._shards()
        try:
            if background:
                future = dcp.async_save(shards, checkpoint_id=str(tmp), process_group=self._group)
                self._pending = (future, tmp, final, name)
                return
            dcp.save(shards, checkpoint_id=str(tmp), no_dist=not self.env.distributed)
        except (OSError, RuntimeError, dcp.CheckpointException) as e:
            raise self._failed(e, tmp, final) from e
        self._complete(tmp, final, name)

    def wait(self) -> None:
        """Complete the background save, if one is under way."""
        if self._pending is None:
            return
        future, tmp, final, name = self._pending
        self._pending = None
        try:
            future.result()
        except (OSError, RuntimeError, dcp.CheckpointException) as e:
            raise self._failed(e, tmp, final) from e
        self._complete(tmp, final, name)

    def abandon(self) -> None:
        """Not a collective: a failed job's background save is not completed (a rank may be
        gone), but its partial folder goes, so a full disk gets its space back."""
        if self._pending is None:
            return
        future, tmp, _, _ = self._pending
        self._pending = None
        try:  # let this rank's writer finish or fail before its files are removed
            future.result(timeout=_ABANDON_WAIT_S)
        except BaseException:  # noqa: B036 - what went wrong is the job's error, said already
            pass
        self._drop(tmp)

    def _drop(self, tmp: Path) -> None:
        """A save's partial folder removed, this rank's shards first (rank 0 may be gone)."""
        for p in tmp.glob(f"__{self.env.rank}_*"):
            remove_quietly(p)
        if self.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)

    def _failed(self, e: BaseException, tmp: Path, final: Path) -> UserError:
        """A write of the shards failed (DCP's CheckpointException, on each rank): the partial
        folder goes, and one line names the OS's cause; the rank's log keeps DCP's message."""
        log.info("rank %d: the checkpoint write failed: %s", self.env.rank, first_line(e, 2000))
        # The free space is asked before it is given back, of checkpoints/: rank 0 may have
        # removed tmp already, and then no rank but it could tell a full disk.
        failed = write_failed(e, final, folder=final.parent)
        self._drop(tmp)
        return failed

    def _complete(self, tmp: Path, final: Path, name: str | None) -> None:
        """Collective: each rank CRCs its own files, then rank 0 writes the manifest, renames
        the folder into place and rotates."""
        mine = {p.name: _entry(p) for p in tmp.glob(f"__{self.env.rank}_*.distcp")}
        shards = all_gather_objects(mine, self.env)
        if self.env.is_main:
            files = {k: v for part in shards for k, v in part.items()}
            for p in tmp.iterdir():  # .metadata, extra.pt, and shards of ranks elsewhere
                if p.is_file() and p.name not in files and p.name != MANIFEST:
                    files[p.name] = _entry(p)
            write_synced(tmp / MANIFEST, json.dumps({"files": files}).encode())
            fsync_dir(tmp)
            swap_into_place(tmp, final)
            if name is None:
                rotate(final.parent, SUFFIX, self.keep)
            log.info("checkpoint: %s", final)
        barrier(self.env)  # nobody races ahead and dies before the folder is in place

    def _start_folder(self, folder: Path, tmp: Path) -> None:
        """Rank 0: checkpoints/ exists, with no killed save's tmp folder left (`wait` ran), and a
        checkpoint whose replacement was killed half-way back under its name."""
        try:
            folder.mkdir(parents=True, exist_ok=True)
            left = [p for p in folder.iterdir() if p.name.endswith((".dcp.tmp", ".dcp.old"))]
            for final in {folder / p.name[1:-4] for p in left if p.name.startswith(".")}:
                whole = left_by_swap(final)  # a swap killed between its renames: put back
                if whole is not None:
                    os.replace(whole, final)
            for p in left:
                shutil.rmtree(p, ignore_errors=True)
            tmp.mkdir()
        except OSError as e:
            raise write_failed(e, tmp) from e

    def _shards(self) -> dict[str, Any]:
        return {m.name: obj.state_dict() for m, obj in self.members if m.sharded}

    def keep_as_best(self, step: int) -> None:
        """Rank 0: step <step>'s folder is also best.dcp (hard links, where possible)."""
        if not self.env.is_main:
            return
        folder = checkpoint_dir(self.output_dir)
        source, tmp = folder / f"step_{step:08d}{SUFFIX}", folder / ".best.dcp.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        ignore = shutil.ignore_patterns(MANIFEST)
        shutil.copytree(source, tmp, ignore=ignore, copy_function=link_or_copy)
        write_synced(tmp / MANIFEST, (source / MANIFEST).read_bytes())  # last: tmp is whole
        fsync_dir(tmp)
        swap_into_place(tmp, folder / f"best{SUFFIX}")

    def _restore(self, path: Path) -> None:
        check_whole(path, "trainer.resume")
        extra = read_archive(path / EXTRA, "trainer.resume")
        shards = self._shards()
        try:
            # collective
            dcp.load(shards, checkpoint_id=str(path), no_dist=not self.env.distributed)
        except (KeyError, ValueError, RuntimeError, TypeError) as e:
            raise UserError(
                f"{path} does not match this job's model/optimizer setup "
                f"({type(e).__name__}: {first_line(e)}): resume with the config it was "
                "trained with (its run's .hydra/config.yaml), or trainer.resume=never"
            ) from e
        state.load_members(self.members, {**extra, **shards}, self.env, path)


def _entry(path: Path) -> list[int]:
    return [path.stat().st_size, crc32(path)]
