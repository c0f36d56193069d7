"""A checkpoint written by an earlier release of the template still resumes: the stored
tests/data/checkpoint_v1/step_00000002.pt (a 2-rank digits job with EMA, written by the
single-file layout of commit 7639aa6; the command is in expected.json) continues to step 4
with the same per-rank losses as the job that wrote it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import FAST
from helpers.inproc import train_ranks

FIXTURE = Path(__file__).parent / "data" / "checkpoint_v1"


def test_a_checkpoint_of_the_previous_layout_resumes_with_the_same_losses(tmp_path: Path) -> None:
    expected = json.loads((FIXTURE / "expected.json").read_text())
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(FIXTURE / "step_00000002.pt", run / "checkpoints")
    summaries = train_ranks(run, *FAST, *expected["overrides"])
    assert [s["steps"] for s in summaries] == [4, 4]
    assert summaries[0]["steps_this_run"] == 2, "resumed at step 2, not trained from scratch"
    for rank, losses in expected["loss_after_resume"].items():
        rows = [
            json.loads(line)
            for line in (run / "stats" / f"{rank}.jsonl").read_text().split("\n")
            if line
        ]
        got = {str(r["step"]): r["loss"] for r in rows if "loss" in r}
        for step, loss in losses.items():
            assert got[step] == pytest.approx(loss, abs=1e-5), (rank, step)
