"""ddp=fsdp2 when things go wrong: a stop signal (preemption), a SIGKILL while a background
checkpoint is being written, and a resume on 4, then 2, then 1 ranks (the shards re-cut for
each world size). All slow: each is several runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FAST, TESTS, user_env
from helpers import ranks
from helpers.inproc import train_here, train_ranks
from helpers.runs import assert_close, final_weights, global_losses

from hydra_ddp import checkpoint

GPT = [*FAST, "data=text", "model=gpt", "model.n_layer=2", "model.n_embd=32", "model.n_head=2",
       "model.dropout=0", "data.block_size=32", "trainer.batch_size=8", "trainer.log_interval=1",
       "ddp=fsdp2"]  # fmt: skip


def _steps(job: Path, rank: int = 0) -> list[int]:
    path = job / "stats" / f"rank{rank}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(ln)["step"] for ln in lines if ln.endswith("}")]


@pytest.mark.slow  # a real self-launched 2-rank job and its resume
def test_sigterm_checkpoints_the_step_exits_143_and_resume_continues(tmp_path: Path) -> None:
    """SIGTERM (what SLURM sends at preemption) to a self-launched fsdp2 job: every rank saves
    its shards of the step in progress into one step_<N>.dcp folder, the job exits 143, and
    a resume continues from step N to the end."""
    args = [*FAST, "ddp=fsdp2", "model._target_=helpers.slow_model.SlowMLP", "+model.sleep_s=0.3",
            "trainer.max_steps=20", "trainer.log_interval=1",
            "trainer.ckpt_interval=0"]  # fmt: skip
    env = user_env(tmp_path)
    env["PYTHONPATH"] += os.pathsep + str(TESTS)
    cmd = [sys.executable, "-m", "hydra_ddp.train", "dist.nproc_per_node=2", *args]
    with open(tmp_path / "launcher.log", "w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        deadline, job = time.monotonic() + 240, None
        while job is None:
            assert proc.poll() is None and time.monotonic() < deadline, "no step 2 logged"
            job = next((p.parents[1] for p in tmp_path.glob("outputs/*/*/stats/rank0.jsonl")
                        if max(_steps(p.parents[1]), default=0) >= 2), None)  # fmt: skip
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    log = (tmp_path / "launcher.log").read_text()
    assert rc == 128 + signal.SIGTERM, log[-3000:]
    newest = checkpoint.latest(job)
    assert newest is not None and newest.suffix == ".dcp", log[-3000:]
    stopped = checkpoint.load(newest)["step"]
    assert newest.name == f"step_{stopped:08d}.dcp" and 2 <= stopped < 20
    for rank in (0, 1):
        assert (
            f"stopped on SIGTERM at step {stopped} of 20"
            in (job / f"train_rank{rank}.log").read_text()
        )
    done = train_ranks(job, *args)
    assert done[0]["steps"] == 20 and done[0]["steps_this_run"] == 20 - stopped
    assert f"resumed from {newest} at step {stopped}" in done.logs[0]
    assert max(_steps(job)) == 20


KILL = [
    "+callbacks.kill._target_=helpers.user_callbacks.SignalAt",
    "+callbacks.kill.signal=SIGKILL",
]


@pytest.mark.slow  # three runs and a killed one
def test_killed_async_save_is_never_picked_and_resume_falls_back(tmp_path: Path) -> None:
    """trainer.async_ckpt=true: step 20's checkpoint is being written in the background when
    both ranks are SIGKILLed (at the end of step 21, before the next save would complete it).
    Its folder never got a checkpoint's name; the resume starts from step 10's and ends with
    the parameters of an uninterrupted run."""
    args = [*GPT, "trainer.max_steps=30", "trainer.ckpt_interval=10", "trainer.async_ckpt=true",
            *KILL]  # fmt: skip
    base = tmp_path / "base"
    train_ranks(base, *args, "+callbacks.kill.at=999")
    job = tmp_path / "job"
    with pytest.raises(ranks.RankFailed):
        train_ranks(job, *args, "+callbacks.kill.at=21")
    folder = job / "checkpoints"
    assert (folder / ".step_00000020.dcp.tmp").is_dir()  # what the background write left
    assert not (folder / "step_00000020.dcp").exists()
    assert checkpoint.latest(job) == folder / "step_00000010.dcp"
    done = train_ranks(job, *args, "+callbacks.kill.at=999")[0]
    assert done["steps"] == 30 and done["steps_this_run"] == 20
    assert not (folder / ".step_00000020.dcp.tmp").exists()  # cleared by the next save
    assert_close(final_weights(job), final_weights(base), atol=1e-6)


@pytest.mark.slow  # four runs, one on 4 ranks
def test_resume_on_4_then_2_then_1_ranks_continues_the_run(tmp_path: Path) -> None:
    """4 ranks x 4 rows to step 4, 2 ranks x 8 rows to step 8, 1 rank x 16 rows to step 12:
    the same global batches as an uninterrupted 2-rank run (the strided order is global), so
    the same losses and final parameters; each resume re-cuts the model's and the
    optimizer's shards for its world size, and the step count continues."""
    common = [*GPT, "trainer.ckpt_interval=4", "scheduler=constant",
              "scheduler.warmup_steps=0"]  # fmt: skip
    base = tmp_path / "base"
    train_ranks(base, *common, "trainer.max_steps=12", timeout=300)
    job = tmp_path / "job"
    four = train_ranks(job, *common, "trainer.max_steps=4", "trainer.batch_size=4",
                       world_size=4, timeout=300)[0]  # fmt: skip
    assert four["steps"] == 4 and four["world_size"] == 4
    two = train_ranks(job, *common, "trainer.max_steps=8")[0]
    assert two["steps"] == 8 and two["steps_this_run"] == 4 and two["world_size"] == 2
    one = train_here(job, *common, "trainer.max_steps=12", "trainer.batch_size=16")
    assert one["steps"] == 12 and one["steps_this_run"] == 4 and one["world_size"] == 1
    la, lb = global_losses(job, 4), global_losses(base, 2)
    assert sorted(la) == list(range(1, 13))
    assert max(abs(la[s] - lb[s]) for s in la) < 1e-4, (la, lb)
    assert_close(final_weights(job), final_weights(base), atol=1e-5)
