"""A short training run of the user's own command, in a subprocess, as a user would run it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path


def test_a_short_run_trains_and_writes_its_summary(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "myproj.train", "debug=fast", "trainer.max_steps=20",
         f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["world_size"] == 1
    assert math.isfinite(summary["train_loss"]) and math.isfinite(summary["val_loss"])
    stats = [json.loads(line) for line in (run_dir / "stats" / "rank0.jsonl").open()]
    assert any("weight_norm" in key for row in stats for key in row)  # callbacks.WeightNorm ran
