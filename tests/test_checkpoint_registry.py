"""A checkpoint holds the members the job declares when it is built: the template's and those
a callback's `checkpoint_members()` returns. Objects of the user's, neither a callback's own
state nor a loop part (helpers.user_callbacks.Notes), are saved in every checkpoint and
restored on resume, on 2 DDP gloo ranks: a global member (rank 0's state) and a per-rank one
(each rank its own). A checkpoint written without the member resumes with it started fresh and
a warning; one declared required is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import FAST
from helpers.inproc import job, train_rank

from hydra_ddp import checkpoint
from hydra_ddp.checkpoint import state
from hydra_ddp.errors import UserError

COMMON = [*FAST, "trainer.ckpt_interval=2"]
NOTES = "+callbacks.notes._target_=helpers.user_callbacks.Notes"


def _ranks(tmp_path: Path, *overrides: str, **kw) -> Any:
    from helpers import ranks

    cfg, run = job(tmp_path, *COMMON, NOTES, *overrides)
    return ranks.run(train_rank, cfg, run, group=False, timeout=240, **kw)


def _restored(tmp_path: Path, rank: int) -> dict[str, Any]:
    return json.loads((tmp_path / f"notes_rank{rank}.json").read_text())


def test_a_declared_member_is_saved_and_restored_on_2_ranks(tmp_path: Path) -> None:
    _ranks(
        tmp_path,
        "trainer.max_steps=2",
        "+callbacks.notes.shared=[1,2.5,x]",
        "+callbacks.notes.mine=notes",
    )
    saved = checkpoint.load(checkpoint.latest(tmp_path))
    assert saved["note"] == {"value": [1, 2.5, "x"]}
    assert [saved["rng"][r]["my_note"] for r in (0, 1)] == [
        {"value": "notes of rank 0"},
        {"value": "notes of rank 1"},
    ], "each rank's own state"

    resumed = _ranks(tmp_path, "trainer.max_steps=4")  # fresh Notes, filled by the resume
    for rank in (0, 1):
        assert resumed[rank]["steps_this_run"] == 2
        assert _restored(tmp_path, rank) == {
            "shared": [1, 2.5, "x"],
            "mine": f"notes of rank {rank}",
        }


@pytest.mark.slow
def test_a_member_missing_from_the_checkpoint_starts_fresh_or_is_refused(tmp_path: Path) -> None:
    from helpers.inproc import train_ranks

    train_ranks(tmp_path, *COMMON, "trainer.max_steps=2")  # no Notes
    with pytest.raises(UserError, match=r"holds no note state, which this job needs"):
        _ranks(tmp_path, "trainer.max_steps=4", "+callbacks.notes.required=true")

    resumed = _ranks(tmp_path, "trainer.max_steps=4")
    assert _restored(tmp_path, 0) == {} and resumed[0]["steps"] == 4
    assert "holds no note state: starting it fresh" in resumed.logs[0]
    assert "holds no my_note state for rank 1: starting it fresh" in resumed.logs[1]


def test_the_users_members_follow_the_defaults_and_replace_one_by_name() -> None:
    mine = state.Member("counter", lambda objects: None)
    monitor = state.Member("monitor", lambda objects: None)
    table = state.members([mine, monitor])
    names = [m.name for m in table]
    assert names == [m.name for m in state.DEFAULT_MEMBERS] + ["counter"]
    assert table[names.index("monitor")] is monitor and table[-1] is mine
    assert list(state.DEFAULT_MEMBERS) == state.members(), "the defaults are not changed"
    with pytest.raises(UserError, match="checkpoint_members\\(\\) gave 'counter'"):
        state.members(["counter"])
