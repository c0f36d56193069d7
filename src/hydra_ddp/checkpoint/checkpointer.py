"""The single-file checkpoints of a DistributedDataParallel run: checkpoints/step_<step>.pt,
written by global rank 0 with every member the job declared (state.py); ddp=fsdp2's sharded
folders are dcp.py's, with the same interface."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable

from hydra_ddp.checkpoint import safe_state, state
from hydra_ddp.checkpoint.files import keep_as_best, save
from hydra_ddp.checkpoint.reading import load
from hydra_ddp.distributed import DistEnv, barrier
from hydra_ddp.errors import UserError

log = logging.getLogger(__name__)


class Checkpointer:
    """The training state on disk: `maybe_save` every trainer.ckpt_interval steps, `save` at
    the end or on a stop signal, `restore` on resume.

    `objects` are what this job checkpoints; what of them a checkpoint holds, and how, is
    `members` (state.members: the defaults and the user's). Rank 0 saves the global members;
    the per-rank ones (every rank's RNG and callback state, a comm hook's error feedback) are
    gathered into the same file. Every rank first takes rank 0's buffers (state.agree). Saving
    and restoring are collective: every rank calls them.
    """

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
        state.agree(self.objects, env)  # collective
        main, refused = None, None
        try:  # what resume could not read is refused now, on every rank alike
            if env.is_main:
                main = safe_state.checked(
                    state.global_state([(m, o) for m, o in self.members if not m.per_rank])
                )
        except UserError as e:
            refused = str(e)
        ranks = state.gather_per_rank(self.members, env, refused)  # collective
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
        """Rank 0: the checkpoint just saved at `step` is also checkpoints/best.pt."""
        if self.env.is_main:
            keep_as_best(self.output_dir, step)

    def restore(self, path: Path) -> None:
        """Load `path` into every member of this job (the position with its resume arithmetic,
        this rank's RNG)."""
        if Path(path).is_dir():
            raise UserError(
                f"{path} is a sharded checkpoint of a ddp=fsdp2 run: resume it with ddp=fsdp2, "
                f"or start from its weights with trainer.init_from={path} and "
                "trainer.resume=never"
            )
        state.load_members(self.members, load(path), self.env, Path(path))
