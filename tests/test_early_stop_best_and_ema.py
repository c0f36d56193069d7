"""Best checkpoint and early stopping on 2 real gloo ranks in process (helpers/ranks.py); EMA of
weights, same-seed runs and torch.compile through the real entry point with 2 self-launched
ranks (slow)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import FAST, ok, python_train, summary
from helpers.inproc import train_ranks

from hydra_ddp import checkpoint

pytestmark = pytest.mark.timeout(600)

TWO = ["dist.nproc_per_node=2", *FAST, "trainer.batch_size=32"]
ONE_JOB = [*FAST, "trainer.batch_size=32"]  # the job TWO starts, run by train_ranks
# lr 0: nothing ever improves after the first evaluation, so early stopping is predictable.
FLAT = [
    "optim.lr=0",
    "trainer.eval_interval=5",
    "trainer.early_stop_patience=2",
    "trainer.monitor=val/acc",
    "trainer.monitor_mode=max",
]


def _logs(job: Path) -> str:
    return "".join(p.read_text() for p in sorted(job.glob("train_rank*.log")))


def test_early_stop_stops_every_rank_at_once_and_survives_a_resume(tmp_path: Path) -> None:
    job = tmp_path / "job"
    # Evaluations at 5 (best) and 10 (one without improvement): no stop yet.
    assert train_ranks(job, *ONE_JOB, *FLAT, "trainer.max_steps=10")[0]["stopped_early"] is False
    # Resumed, the patience count (1) comes back from the checkpoint: the evaluation at 15 is
    # the second in a row without improvement. Counted afresh, it would stop at 20.
    done = train_ranks(job, *ONE_JOB, *FLAT, "trainer.max_steps=40")
    s = summary(job)
    assert done[0]["steps"] == done[1]["steps"] == s["steps"] == 15
    assert s["stopped_early"] is True, s
    assert s["best_step"] == 5 and s["monitor"] == "val/acc"
    for rank in (0, 1):  # both ranks ended at the same step, no hang
        assert "early stop at step 15: val/acc has not improved" in done.logs[rank], done.logs[
            rank
        ][-2000:]
    best = checkpoint.load(job / "checkpoints" / "best.pt")
    assert best["step"] == 5 and best["monitor"]["best"] == pytest.approx(s["best"])


def test_best_checkpoint_is_kept_next_to_the_newest_k(tmp_path: Path) -> None:
    job = tmp_path / "job"
    train_ranks(
        job,
        *ONE_JOB,
        "trainer.max_steps=30",
        "trainer.eval_interval=5",
        "trainer.ckpt_interval=5",
        "trainer.keep_ckpts=1",
    )
    s = summary(job)
    names = sorted(p.name for p in (job / "checkpoints").iterdir())
    assert names == ["best.pt", "step_00000030.pt"], names  # rotation never takes best.pt
    best = checkpoint.load(job / "checkpoints" / "best.pt")
    assert best["step"] == s["best_step"] and s["best"] == pytest.approx(
        min(s["val_loss"], best["monitor"]["best"])
    )
    # The newest checkpoint is not taken for the best one: resume=auto ignores best.pt.
    assert checkpoint.latest(job).name == "step_00000030.pt"


def _ema_job(tmp_path: Path, name: str, *extra: str) -> Path:
    job = tmp_path / name
    ok(
        python_train(
            tmp_path,
            *TWO,
            "trainer.ema_decay=0.9",
            "model.dropout=0.2",
            "trainer.max_steps=12",
            "trainer.ckpt_interval=6",
            *extra,
            f"hydra.run.dir={job}",
        )
    )
    return job


@pytest.mark.slow  # tens of seconds of 2-rank jobs: run by .ci/run after the default suite
def test_ema_is_evaluated_checkpointed_and_resumed_exactly(tmp_path: Path) -> None:
    straight = _ema_job(tmp_path, "straight")
    # The same job, started again from the straight run's checkpoint at step 6.
    middle = straight / "checkpoints" / "step_00000006.pt"
    resumed = _ema_job(tmp_path, "resumed", f"trainer.resume={middle}")
    a = checkpoint.load(checkpoint.latest(straight))
    b = checkpoint.load(checkpoint.latest(resumed))
    assert checkpoint.load(middle)["ema"]["n_averaged"].item() == 6
    assert a["ema"]["n_averaged"].item() == b["ema"]["n_averaged"].item() == 12
    for key, value in a["ema"].items():
        assert torch.allclose(value.float(), b["ema"][key].float(), atol=1e-6), key
    # The average is what was evaluated: it differs from the raw weights, and the resumed
    # run's validation loss equals the straight run's.
    w = "module.net.0.weight"
    assert not torch.allclose(a["ema"][w], a["model"]["net.0.weight"])
    assert summary(resumed)["val_loss"] == pytest.approx(summary(straight)["val_loss"], rel=1e-6)


@pytest.mark.slow  # tens of seconds of 2-rank jobs: run by .ci/run after the default suite
def test_same_seed_runs_give_identical_parameters(tmp_path: Path) -> None:
    """Two runs of one command on 2 self-launched ranks (dropout on) end with the same weights:
    the seeds reproduce a run. On CPU this holds without trainer.deterministic too; it is on
    here to show it works on 2 ranks, and its settings are checked where they can fail
    (test_train.py)."""
    jobs = []
    for name in ("one", "two"):
        job = tmp_path / name
        ok(
            python_train(
                tmp_path,
                *TWO,
                "trainer.deterministic=true",
                "trainer.max_steps=8",
                "model.dropout=0.2",
                f"hydra.run.dir={job}",
            )
        )
        jobs.append(checkpoint.load(checkpoint.latest(job))["model"])
    for key in jobs[0]:
        assert torch.equal(jobs[0][key], jobs[1][key]), key


@pytest.mark.slow
def test_compiled_job_trains_checkpoints_without_prefixes_and_resumes(tmp_path: Path) -> None:
    """trainer.compile=true on CPU (inductor with gcc: the first compile takes tens of seconds
    on 2 cores, hence the slow set)."""
    job = tmp_path / "job"
    common = [*TWO, "trainer.compile=true", f"hydra.run.dir={job}"]
    ok(python_train(tmp_path, *common, "trainer.max_steps=4", timeout=900))
    state = checkpoint.load(checkpoint.latest(job))
    assert not [k for k in state["model"] if "_orig_mod" in k]
    proc = ok(python_train(tmp_path, *common, "trainer.max_steps=8", timeout=900))
    assert "at step 4" in proc.stderr + _logs(job)
    assert summary(job)["steps"] == 8 and summary(job)["steps_this_run"] == 4
