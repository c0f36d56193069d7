"""Callbacks (`callbacks.NAME._target_`), through the real loop: in process on one rank, and on
two gloo ranks of helpers/ranks.py. Each hook fires as documented (on_epoch_end once per epoch,
also with grad_accum > 1, limit_train_batches and a resume in the middle of an epoch), their
state rides in the checkpoint, ctx.log reaches every rank's stats file, and a failing or
hook-less callback stops the run with one line naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FAST
from helpers.inproc import train_here, train_ranks

from hydra_ddp.errors import UserError

COUNT = ["+callbacks.count._target_=helpers.user_callbacks.Count"]


def _counts(job: Path, rank: int = 0) -> dict:
    return json.loads((job / f"count_rank{rank}.json").read_text())


def _records(job: Path, rank: int, key: str) -> list[dict]:
    lines = (job / "stats" / f"rank{rank}.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if key in r]


def test_two_ranks_count_steps_and_epochs_with_grad_accum(tmp_path: Path) -> None:
    # digits: 1257 train rows, batch 64 on 2 ranks -> 10 batches per rank and epoch; with
    # grad_accum=2, 5 optimizer steps per epoch: 3 epochs are 15 steps.
    summaries = train_ranks(
        tmp_path, *FAST, *COUNT, "+callbacks.count.every=5", "trainer.epochs=3",
        "trainer.grad_accum=2", "trainer.eval_interval=5", "trainer.log_interval=5",
    )  # fmt: skip
    assert summaries[0]["steps"] == summaries[1]["steps"] == 15
    for rank in (0, 1):
        counts = _counts(tmp_path, rank)
        assert counts["train_start"] == 1
        assert counts["step_end"] == 15 and counts["steps"] == list(range(1, 16))
        assert counts["epoch_end"] == 3 and counts["epochs"] == [0, 1, 2]
        assert counts["eval_end"] == 3  # steps 5 and 10, and the end of the run
        logged = _records(tmp_path, rank, "callback_steps")
        assert [r["step"] for r in logged] == [5, 10, 15]
        assert [r["rank_plus_step"] for r in logged] == [rank + 5, rank + 10, rank + 15]
        assert all(r["rank"] == rank for r in logged)


def test_epoch_end_once_per_epoch_with_limit_and_across_a_resume(tmp_path: Path) -> None:
    # limit_train_batches=3: 3 steps an epoch. Stop at step 4 (epoch 1, batch 1), resume to 9.
    common = [*FAST, *COUNT, "trainer.limit_train_batches=3", "trainer.ckpt_interval=4"]
    train_here(tmp_path, *common, "trainer.max_steps=4")
    first = _counts(tmp_path)
    assert first["epochs"] == [0] and first["steps"] == [1, 2, 3, 4]
    train_here(tmp_path, *common, "trainer.max_steps=9")
    after = _counts(tmp_path)
    # Restored from the step-4 checkpoint: counts continue, epoch 0 is not ended twice.
    assert after["steps"] == list(range(1, 10))
    assert after["epochs"] == [0, 1, 2] and after["epoch_end"] == 3
    assert after["train_start"] == 2  # one per run


def test_a_failing_callback_stops_with_one_line_naming_it(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"callbacks\.boom \(helpers\.user_callbacks\.Boom\) "
                       r"failed in on_step_end at step 3: ValueError: boom at three"):  # fmt: skip
        train_here(tmp_path, *FAST, "+callbacks.boom._target_=helpers.user_callbacks.Boom")


def test_a_callback_without_hooks_or_with_a_typo_is_refused_before_training(
    tmp_path: Path,
) -> None:
    with pytest.raises(UserError, match=r"callbacks\.none \(NoHooks\) has none of"):
        train_here(tmp_path, *FAST, "+callbacks.none._target_=helpers.user_callbacks.NoHooks")
    with pytest.raises(UserError, match=r"callbacks\.count\.evry is not an argument"):
        train_here(tmp_path, *FAST, *COUNT, "+callbacks.count.evry=2")
    assert not (tmp_path / "checkpoints").exists()


def test_the_text_jobs_sample_callback_logs_generated_text(tmp_path: Path) -> None:
    train_here(
        tmp_path, *FAST, "experiment=text_gpt", "trainer.max_steps=2", "trainer.eval_interval=1",
        "trainer.limit_eval_batches=2", "callbacks.sample_text.length=40",
    )  # fmt: skip
    samples = _records(tmp_path, 0, "sample")
    assert [r["step"] for r in samples] == [1, 2]
    assert all(isinstance(r["sample"], str) and len(r["sample"]) == 40 for r in samples)
