"""Resumes that change the job, and what a run records (in process, one rank): the data
position is kept in rows, so a resume with another batch size continues at the first unseen
row (the rows seen over the run equal an uninterrupted run's, or the log says how many are
trained again); trainer.epochs counts passes whatever grad_accum is; a stats file cut
mid-record is repaired before anything is appended; run.json records the code and versions;
a changed optim.lr is applied and said."""

from __future__ import annotations

import collections
import json
import logging
import re
from pathlib import Path

import pytest
import torch
from conftest import FAST
from helpers.inproc import train_here, train_ranks

from hydra_ddp.data import Strided, epoch_rows

ROWS = 256  # helpers.user_data.Blobs rows in the training split


def _job(reads: Path, batch: int, *extra: str) -> list[str]:
    log = f",log_dir:'{reads}'"
    return [
        *FAST, "data=torch",
        f"data.train={{_target_:helpers.user_data.Blobs,rows:{ROWS},seed:0{log}}}",
        "data.val={_target_:helpers.user_data.Blobs,rows:32,seed:1}",
        "data.test={_target_:helpers.user_data.Blobs,rows:32,seed:2}",
        "+data.spec={in_features:8,out_features:4}", f"trainer.batch_size={batch}",
        "trainer.ckpt_interval=1", "trainer.log_interval=1", *extra,
    ]  # fmt: skip


def _rows_read(reads: Path) -> collections.Counter:
    return collections.Counter(
        int(line) for p in reads.glob("reads_*") for line in p.read_text().split()
    )


@pytest.mark.parametrize("first, second", [(32, 64), pytest.param(64, 32, marks=pytest.mark.slow)])
def test_a_resume_with_another_batch_size_sees_each_row_once(
    tmp_path: Path, first: int, second: int, caplog
) -> None:
    reads = tmp_path / "reads"
    reads.mkdir()
    run = tmp_path / "run"
    stop = 128 // first  # half an epoch of rows, in the first batch size
    train_here(run, *_job(reads, first, f"trainer.max_steps={stop}"))
    with caplog.at_level(logging.WARNING):
        # The rest of the epoch, in the second batch size: 128 more rows.
        train_here(run, *_job(reads, second, f"trainer.max_steps={stop + 128 // second}"))
    assert _rows_read(reads) == collections.Counter(range(ROWS)), "each row exactly once"
    said = [r.message for r in caplog.records if "continues at its row 128" in r.message]
    assert said and said[0].endswith(", exactly"), said


def test_a_resume_that_cannot_be_exact_says_how_many_rows_repeat(tmp_path: Path, caplog) -> None:
    reads = tmp_path / "reads"
    reads.mkdir()
    run = tmp_path / "run"
    train_here(run, *_job(reads, 48, "trainer.max_steps=3"))  # 144 rows
    with caplog.at_level(logging.WARNING):
        train_here(run, *_job(reads, 64, "trainer.max_steps=4"))
    line = next(r.message for r in caplog.records if "continues at its row 144" in r.message)
    assert "(batch 2 here); 16 rows of it are trained again" in line
    assert sum(_rows_read(reads).values()) == 144 + 64  # one more step: rows 128-191


def test_a_resume_that_changes_the_sampler_says_what_it_reads_twice_and_skips(
    tmp_path: Path,
) -> None:
    """2 ranks, 256 rows, batches of 32: 4 batches a rank and epoch. Half an epoch strided, then
    the rest with sampler=sharded: the warning's counts are the rows the dataset served twice
    and never in that epoch."""
    reads = tmp_path / "reads"
    reads.mkdir()
    run = tmp_path / "run"
    train_ranks(run, *_job(reads, 32, "trainer.max_steps=2"))
    first = _rows_read(reads)
    assert sum(first.values()) == 128 and set(first.values()) == {1}
    second = train_ranks(run, *_job(reads, 32, "trainer.max_steps=4", "sampler=sharded"))
    served = _rows_read(reads)
    assert sum(served.values()) == 256  # the epoch's 8 batches of 32, half under each rule
    twice = sum(1 for count in served.values() if count > 1)
    never = ROWS - len(served)
    said = re.search(r"read in another order: (\d+) rows of the epoch are read twice and "
                     r"(\d+) skipped", second.logs[0])  # fmt: skip
    assert said, second.logs[0][-3000:]
    assert (int(said.group(1)), int(said.group(2))) == (twice, never)
    assert twice > 0, "a strided half and a sharded half of one epoch cannot match by chance"
    assert "on 2 rank(s) with sampler=strided, this job" in second.logs[0]  # as checkpointed
    state = torch.load(run / "checkpoints" / "step_00000004.pt", weights_only=True)
    assert state["sampler"]["policy"] == "sharded" and state["sampler"]["seed"] == 0


def test_sampler_changes_that_keep_the_order_are_exact() -> None:
    """Counted in process: settings that do not change which rows remain (no shuffle: drop_last
    on rows that divide evenly; another seed) read each row once; a shuffle that does not."""
    plain = {"policy": "strided", "shuffle": False, "seed": 0, "drop_last": False,
             "shard_by": "rows", "rotate": False}  # fmt: skip
    old = epoch_rows.Setup(plain, 2, 8)
    for change in ({"drop_last": True}, {"seed": 5}, {"rotate": True}):
        new = epoch_rows.Setup({**plain, **change}, 2, 8)
        assert epoch_rows.twice_and_skipped(old, new, 64, [64], 0, 2, 2) == (0, 0), change
    assert not epoch_rows.reading_order_changed(
        plain, {**plain, "seed": 5}, 2, 2
    )  # unshuffled: no seed
    shuffled = epoch_rows.Setup({**plain, "shuffle": True}, 2, 8)
    twice, skipped = epoch_rows.twice_and_skipped(old, shuffled, 64, [64], 0, 2, 2)
    assert twice == skipped > 0  # as many read again as left out, each epoch reads 64


def test_epochs_count_passes_whatever_grad_accum_is(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.INFO):
        s = train_here(tmp_path, *FAST, "trainer.epochs=1", "trainer.grad_accum=25")
    # digits: 20 batches of 64 a rank and epoch; one step of 20 micro-batches, not 25.
    assert s["epochs"] == 1 and s["steps"] == 1
    assert any("the last step accumulates 20 of trainer.grad_accum=25" in r.message
               for r in caplog.records)  # fmt: skip
    assert any("| 0.8 steps/epoch |" in r.message for r in caplog.records)


def test_a_stats_file_cut_mid_record_is_repaired_on_resume(tmp_path: Path) -> None:
    job = [*FAST, "trainer.log_interval=5", "trainer.ckpt_interval=10"]
    train_here(tmp_path, *job, "trainer.max_steps=10")
    stats = tmp_path / "stats" / "rank0.jsonl"
    text = stats.read_text()
    stats.write_text(text + text.splitlines()[-1][:25])  # a crash in the middle of a write
    train_here(tmp_path, *job, "trainer.max_steps=20")
    records = [json.loads(line) for line in stats.read_text().splitlines()]  # all parse
    assert [r["step"] for r in records] == [5, 10, 15, 20]


def test_run_json_records_code_versions_and_each_resume(tmp_path: Path) -> None:
    train_here(tmp_path, *FAST, "trainer.max_steps=4", "trainer.ckpt_interval=2")
    train_here(tmp_path, *FAST, "trainer.max_steps=6", "optim.lr=0.004")
    runs = json.loads((tmp_path / "run.json").read_text())["runs"]
    assert len(runs) == 2  # a resume appends
    first = runs[0]
    assert first["versions"]["torch"] == torch.__version__ and first["world_size"] == 1
    assert {"hydra-core", "omegaconf", "wandb", "numpy"} <= set(first["versions"])
    git = first["git"]
    assert len(git["commit"]) == 40 and isinstance(git["dirty"], bool)
    # Dirty by changes to tracked files: their patch is beside run.json; by untracked files
    # alone: they are listed (tests/test_provenance.py checks both in a repo of its own).
    if git["dirty"]:
        assert (tmp_path / git["diff"]).is_file() if "diff" in git else git["untracked"]
    assert first["command"] and first["hosts"]


@pytest.mark.slow
def test_a_changed_learning_rate_on_resume_is_applied_and_said(tmp_path: Path, caplog) -> None:
    train_here(tmp_path, *FAST, "trainer.max_steps=4", "trainer.ckpt_interval=2")
    with caplog.at_level(logging.WARNING):
        train_here(tmp_path, *FAST, "trainer.max_steps=6", "optim.lr=0.02")
    said = [r.message for r in caplog.records if r.message.startswith("optim.lr 0.002 -> 0.02")]
    assert said and "applied to all parameter groups" in said[0]
    state = torch.load(tmp_path / "checkpoints" / "step_00000006.pt", weights_only=True)
    assert {g["initial_lr"] for g in state["optimizer"]["param_groups"]} == {0.02}


class Reversed(Strided):
    """A user's policy: Strided's positions read from the end; declares its settings."""

    def __init__(self, drop_last: bool):
        super().__init__(shuffle=False, seed=0, drop_last=drop_last)

    def sampler(self, rows_held, parts, rank, world, batch_size):
        strided = super().sampler(rows_held, parts, rank, world, batch_size)
        strided._rows = lambda ids, order, f=strided._rows: rows_held - 1 - f(ids, order)
        return strided

    def settings(self):
        return {"_target_": f"{__name__}.Reversed", "drop_last": self.drop_last}


class Undeclared(Reversed):
    def settings(self):
        return None


def test_a_user_policy_that_declares_its_settings_is_counted_on_resume() -> None:
    """Its recorded settings rebuild it: from strided to reversed mid-epoch, the rows read
    twice and skipped are counted as for the built-in policies."""
    reversed_ = epoch_rows.settings(Reversed(False), 0)
    assert reversed_ == {"_target_": f"{__name__}.Reversed", "drop_last": False}
    plain = epoch_rows.settings(Strided(False, 0, False), 0)
    assert epoch_rows.reading_order_changed(plain, reversed_, 2, 2)
    assert not epoch_rows.reading_order_changed(reversed_, dict(reversed_), 2, 2)
    old, new = epoch_rows.Setup(plain, 2, 8), epoch_rows.Setup(reversed_, 2, 8)
    # 2 of 4 batches of 64 rows read forwards (rows 0..31), the rest backwards (rows 0..31
    # again): 32 read twice, and rows 32..63 skipped.
    assert epoch_rows.twice_and_skipped(old, new, 64, [64], 0, 2, 2) == (32, 32)


def test_a_user_policy_without_settings_says_a_resume_cannot_be_counted(caplog) -> None:
    undeclared = epoch_rows.settings(Undeclared(False), 0)
    assert undeclared == {"policy": f"{__name__}.Undeclared", "undeclared": True}
    assert epoch_rows.reading_order_changed(undeclared, dict(undeclared), 2, 2)  # it cannot be told

    class Source:
        def num_rows(self, split):
            return 64

    setup = epoch_rows.Setup(undeclared, 2, 8)
    with caplog.at_level(logging.INFO):
        epoch_rows.say_reordered(Path("ck.pt"), setup, setup, Source(), 0, 2, 2, 0)
    (line,) = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert "declares no settings()" in line and f"{__name__}.Undeclared" in line
    assert "\n" not in line


def test_a_resume_that_changes_which_rows_are_training_rows_says_how_many(
    tmp_path: Path, caplog
) -> None:
    """digits (the default data): the checkpoint records the split; a resume with another
    data.split_seed warns with the counts of rows that changed sides, the same resume as before
    says nothing."""
    from hydra_ddp.data.sources import _split_rows

    run, common = tmp_path / "run", [*FAST, "trainer.ckpt_interval=1", "trainer.eval_interval=0"]
    train_here(run, *common, "trainer.max_steps=2")
    saved = torch.load(run / "checkpoints" / "step_00000002.pt", weights_only=True)["split"]
    assert saved["settings"] == {"val_fraction": 0.15, "test_fraction": 0.15, "split_seed": 0}
    with caplog.at_level(logging.WARNING, logger="hydra_ddp.data.split_record"):
        train_here(run, *common, "trainer.max_steps=3")
        assert not [r for r in caplog.records if r.name == "hydra_ddp.data.split_record"]
        train_here(run, *common, "trainer.max_steps=4", "data.split_seed=5")
    (line,) = [r.message for r in caplog.records if r.name == "hydra_ddp.data.split_record"]
    then, now = _split_rows(1797, 0.15, 0.15, 0), _split_rows(1797, 0.15, 0.15, 5)
    held_then = {*then["val"], *then["test"]}
    trained = len(held_then & set(now["train"]))
    held = len(set(then["train"]) - set(now["train"]))
    assert trained > 0 and held > 0
    assert "step_00000003.pt was trained on another split" in line
    assert "data.split_seed=0 then, 5 now" in line, line
    assert f": {trained} of its val/test rows are training rows now and {held} of its " in line


def test_a_run_started_from_a_file_continues_from_its_own_checkpoints(
    tmp_path: Path, caplog
) -> None:
    """`trainer.resume=<another run's file> hydra.run.dir=b`, stopped, then the same command
    again (the stop line's advice, a requeue): it continues b, where it went back to the file,
    retrained, and the rotation (highest steps kept) deleted b's new checkpoints as written."""
    first = tmp_path / "a"
    train_here(first, *FAST, "trainer.max_steps=4", "trainer.ckpt_interval=2")
    start = f"trainer.resume={first / 'checkpoints' / 'step_00000004.pt'}"
    run = tmp_path / "b"
    train_here(run, *FAST, start, "trainer.max_steps=8", "trainer.ckpt_interval=2")
    with caplog.at_level(logging.INFO):
        done = train_here(run, *FAST, start, "trainer.max_steps=12", "trainer.ckpt_interval=2")
    assert done["steps_this_run"] == 4, done  # steps 9-12 only
    assert any("starts this run only" in r.message and "step_00000008" in r.message
               for r in caplog.records)  # fmt: skip
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [
        "step_00000010.pt", "step_00000012.pt"
    ]  # fmt: skip


def test_going_back_to_an_earlier_checkpoint_of_the_run_keeps_the_later_ones(
    tmp_path: Path, caplog
) -> None:
    """`trainer.resume=<this run's step 4>` in a run that reached step 8: the later ones move
    to checkpoints.before-1/, or the rotation would delete each new checkpoint as written."""
    run = tmp_path / "run"
    train_here(run, *FAST, "trainer.max_steps=8", "trainer.ckpt_interval=2", "trainer.keep_ckpts=3")
    back = f"trainer.resume={run / 'checkpoints' / 'step_00000004.pt'}"
    with caplog.at_level(logging.WARNING):
        done = train_here(run, *FAST, back, "trainer.max_steps=10", "trainer.ckpt_interval=2",
                          "trainer.keep_ckpts=3")  # fmt: skip
    assert done["steps_this_run"] == 6, done
    assert sorted(p.name for p in (run / "checkpoints.before-1").iterdir()) == [
        "step_00000006.pt", "step_00000008.pt"
    ]  # fmt: skip
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [
        "step_00000006.pt", "step_00000008.pt", "step_00000010.pt"
    ]  # fmt: skip
    assert any("2 later checkpoint(s) of this run were moved" in r.message for r in caplog.records)


def test_weights_from_the_runs_own_checkpoints_with_resume_never_are_refused_first(
    tmp_path: Path,
) -> None:
    """resume=never moves the run's checkpoints aside, so init_from could no longer read the
    file it names (the run dir was left with its checkpoints moved and no new run)."""
    from hydra_ddp.errors import UserError

    run = tmp_path / "run"
    train_here(run, *FAST, "trainer.max_steps=4", "trainer.ckpt_interval=2")
    before = sorted(p.relative_to(run).as_posix() for p in run.rglob("*"))
    for weights in (run / "checkpoints" / "step_00000004.pt", run):
        with pytest.raises(UserError, match="is in this run's checkpoints, which trainer.resume"):
            train_here(run, *FAST, "trainer.resume=never", f"trainer.init_from={weights}")
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == before


def test_a_re_run_that_only_evaluates_writes_no_made_up_loss(tmp_path: Path, caplog) -> None:
    """Killed after its last checkpoint and before summary.json: the re-run evaluates and
    writes the summary; it trained no step, so its loss and rate are null, with no
    'not finite' warning that would say the run diverged."""
    run = tmp_path / "run"
    first = train_here(run, *FAST, "trainer.max_steps=4", "trainer.ckpt_interval=2")
    (run / "summary.json").unlink()
    with caplog.at_level(logging.WARNING):
        again = train_here(run, *FAST, "trainer.max_steps=4", "trainer.ckpt_interval=2")
    assert (again["steps"], again["steps_this_run"]) == (4, 0)
    assert again["train_loss"] is None and again["samples_per_s"] is None
    assert again["val_loss"] == pytest.approx(first["val_loss"])
    assert not any("not finite" in r.message for r in caplog.records)
    assert json.loads((run / "summary.json").read_text())["train_loss"] is None
