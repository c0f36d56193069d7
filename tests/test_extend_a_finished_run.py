"""A finished run extended with a larger trainer.max_steps: the last checkpoint is written after
the final evaluation's `on_eval_end`, so the callbacks' state in it counts that evaluation, and
the extension continues their counters instead of repeating one."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import FAST
from helpers.inproc import train_here

from hydra_ddp import checkpoint

COUNT = ["+callbacks.count._target_=helpers.user_callbacks.Count", "trainer.eval_interval=5"]


def test_the_final_checkpoint_holds_the_last_evaluations_callback_state(tmp_path: Path) -> None:
    train_here(tmp_path, *FAST, *COUNT, "trainer.max_steps=10")
    counts = json.loads((tmp_path / "count_rank0.json").read_text())
    assert counts["eval_end"] == 2  # step 5, and the end of the run at step 10
    last = checkpoint.latest(tmp_path)
    assert last is not None and last.name == "step_00000010.pt"
    saved = checkpoint.load(last)["rng"][0]["callbacks"]["count"]["counts"]
    assert saved["eval_end"] == 2 and saved["step_end"] == 10

    summary = train_here(tmp_path, *FAST, *COUNT, "trainer.max_steps=15")
    assert summary["steps"] == 15 and summary["steps_this_run"] == 5
    counts = json.loads((tmp_path / "count_rank0.json").read_text())
    assert counts["eval_end"] == 3  # continued: 2 before, the end of the run at step 15
    assert counts["steps"] == list(range(1, 16)) and counts["train_start"] == 2
    saved = checkpoint.load(checkpoint.latest(tmp_path))["rng"][0]["callbacks"]["count"]["counts"]
    assert saved["eval_end"] == 3
