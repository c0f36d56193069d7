"""What every rank meets alike is said once, by rank 0: a damaged checkpoint skipped when the
job looks for the newest ("skipping ..."), and the position mapped onto another number of ranks
on resume ("counted batches of ... on 3 rank(s), this job ... on 2"). In process on 2 gloo
ranks, through the job's own start (`prepare_job`) and its position's restore."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import FAST
from helpers import ranks
from helpers.inproc import job, prepare_job

from hydra_ddp.checkpoint.state import restoring
from hydra_ddp.loop.checkpointing import _counting
from hydra_ddp.loop.position import Position, PositionState


def _start_and_resume(env, cfg, run) -> None:
    started = prepare_job(cfg, env, run)  # skips the damaged newest checkpoint for step 6's
    here = _counting(started)
    state = PositionState(Position(), here)
    saved = {"step": 12, "epoch": 0, "batch_in_epoch": 4, "world_size": 3, "sampler": here.sampler}
    with restoring(run.output_dir / "checkpoints" / "step_00000012.pt"):
        state.load_state_dict({**saved, "batch_size": cfg.trainer.batch_size})


def test_what_every_rank_meets_alike_is_said_once(tmp_path: Path) -> None:
    cfg, run = job(tmp_path / "run", *FAST, "trainer.batch_size=48")
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    # An intact checkpoint before the damaged newest one (with none, the resume is refused).
    torch.save({"model": {}, "step": 6}, folder / "step_00000006.pt")
    (folder / "step_00000012.pt").write_bytes(b"not a zip archive")
    results = ranks.run(_start_and_resume, cfg, run, world_size=2, timeout=60)
    said = ["skipping ", "counted batches of 48 rows on 3 rank(s), this job 48 on 2"]
    for line in said:
        assert line in results.logs[0], results.logs[0][-2000:]
        assert line not in results.logs[1] + results.outputs[1], (line, results.logs[1])
