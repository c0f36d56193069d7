"""scripts/slurm_example.sbatch without a cluster: stand-ins for `srun` (runs the command here)
and `scontrol` (names this host; records a requeue), one SLURM_JOB_ID for both runs as a requeue
keeps it. The time-limit warning (USR1 to the batch shell) becomes SIGTERM for every rank, the
ranks checkpoint together, the script requeues the job; the second run, with the same job id,
resumes in the same run dir from that checkpoint."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import REPO, user_env

pytestmark = pytest.mark.slow  # two 2-rank torchrun jobs: .ci/run runs it after the default

SRUN = """#!/bin/bash
# srun stand-in: drop srun's own options, run the command here (as the job step's one task).
while [[ "$1" == --* ]]; do shift; done
exec "$@"
"""
SCONTROL = """#!/bin/bash
# scontrol stand-in: this host is the allocation; requeues are recorded.
case "$1" in
  show) echo localhost ;;
  requeue) echo "requeue $2" >> "$STANDIN_LOG" ;;
esac
"""


def _stand_ins(tmp: Path) -> dict[str, str]:
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    job_id = str(random.randint(100_000, 900_000))
    return user_env(
        tmp,
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        STANDIN_LOG=str(tmp / "standin.log"),
        SLURM_JOB_ID=job_id,
        SLURM_JOB_NODELIST="localhost",
        SLURM_JOB_NUM_NODES="1",
        SLURM_CPUS_PER_TASK="2",
        GPUS_PER_NODE="2",
        HYDRA_DDP_DIR=str(tmp),
        PYTHON=os.environ.get("PYTHON", "python"),
    )


def _batch(env: dict[str, str], *overrides: str) -> subprocess.Popen:
    script = REPO / "scripts" / "slurm_example.sbatch"
    return subprocess.Popen(
        ["bash", str(script), *overrides],
        cwd=env["HYDRA_DDP_DIR"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_a_requeued_batch_job_resumes_in_the_same_dir(tmp_path: Path) -> None:
    import sys

    env = _stand_ins(tmp_path)
    env["PYTHON"] = sys.executable
    job = [
        "logger=none",
        "trainer.progress=false",
        "trainer.max_steps=4000",
        "trainer.log_interval=10",
    ]
    run_dir = tmp_path / "outputs" / "slurm" / env["SLURM_JOB_ID"]
    first = _batch(env, *job)
    stats = run_dir / "stats" / "rank0.jsonl"
    deadline = time.monotonic() + 120
    while not (stats.exists() and stats.read_text().count("\n") >= 3):
        assert first.poll() is None, first.communicate()[0][-4000:]
        assert time.monotonic() < deadline, "no training progress"
        time.sleep(0.2)
    first.send_signal(signal.SIGUSR1)  # SLURM's --signal=B:USR1@120
    out, _ = first.communicate(timeout=120)
    assert first.returncode == 0, out[-4000:]
    assert "time limit near (USR1)" in out and f"requeued job {env['SLURM_JOB_ID']}" in out
    assert "Traceback" not in out, out[-4000:]  # hydra_ddp.distributed.torchrun: no SignalException
    assert (tmp_path / "standin.log").read_text().split() == ["requeue", env["SLURM_JOB_ID"]]
    logs = "".join(p.read_text() for p in run_dir.glob("train_rank*.log"))
    assert "stopped on SIGTERM at step" in logs, logs[-3000:]
    saved = sorted((run_dir / "checkpoints").glob("step_*.pt"))
    assert saved, "the stop wrote a checkpoint"
    step = int(saved[-1].stem.split("_")[1])

    # The requeued job: same id, same dir, resumes from that checkpoint and finishes.
    second = _batch(env, *job[:-2], "trainer.max_steps=" + str(step + 20))
    out, _ = second.communicate(timeout=180)
    assert second.returncode == 0, out[-4000:]
    logs = "".join(p.read_text() for p in run_dir.glob("train_rank*.log"))
    assert f"resumed from {saved[-1]} at step {step}" in logs
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == step + 20 and summary["steps_this_run"] == 20
