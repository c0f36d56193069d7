"""A checkpoint holds what the registry lists (hydra_ddp.checkpoint.state): an object of the
user's, neither a callback nor a loop part, registered with one `state.register` call, is saved
in every checkpoint and restored on resume, on 2 DDP gloo ranks: a global member (rank 0's
state) and a per-rank one (each rank its own). A checkpoint written without the member resumes
with it started fresh and a warning; one registered as required is refused in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import FAST
from helpers.inproc import job, train_rank

from hydra_ddp import checkpoint
from hydra_ddp.errors import UserError

COMMON = [*FAST, "trainer.ckpt_interval=2"]


class Note:
    """A user's state: whatever `value` holds, checkpointed as is."""

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def _train_with(env, cfg, run, values: dict[str, Any] | None, required: bool = False) -> dict:
    """A rank: register a global and a per-rank Note (set to `values`, with the rank in the
    per-rank one; None: fresh), train, and return what the Notes hold after the run's resume."""
    from hydra_ddp.checkpoint import state

    before = list(state.MEMBERS)
    shared, mine = Note(), Note()
    if values is not None:
        shared.value, mine.value = values["shared"], f"{values['mine']} of rank {env.rank}"
    restored: dict[str, Any] = {}

    class Watch(Note):  # what the resume loaded, before the run goes on
        def load_state_dict(self, state_: dict[str, Any]) -> None:
            super().load_state_dict(state_)
            restored[self.key] = self.value

    watched_shared, watched_mine = Watch(shared.value), Watch(mine.value)
    watched_shared.key, watched_mine.key = "shared", "mine"
    try:
        state.register(state.Member("note", lambda parts: watched_shared, required=required))
        state.register(state.Member("my_note", lambda parts: watched_mine, per_rank=True))
        summary = train_rank(env, cfg, run)
    finally:
        state.MEMBERS[:] = before
    return {"summary": summary, "restored": restored}


def _ranks(tmp_path: Path, *overrides: str, values=None, required=False, **kw) -> Any:
    from helpers import ranks

    cfg, run = job(tmp_path, *COMMON, *overrides)
    return ranks.run(_train_with, cfg, run, values, required, group=False, timeout=240, **kw)


def test_a_registered_member_is_saved_and_restored_on_2_ranks(tmp_path: Path) -> None:
    _ranks(tmp_path, "trainer.max_steps=2", values={"shared": [1, 2.5, "x"], "mine": "notes"})
    saved = checkpoint.load(checkpoint.latest(tmp_path))
    assert saved["note"] == {"value": [1, 2.5, "x"]}
    assert [saved["rng"][r]["my_note"] for r in (0, 1)] == [
        {"value": "notes of rank 0"},
        {"value": "notes of rank 1"},
    ], "each rank's own state"

    resumed = _ranks(tmp_path, "trainer.max_steps=4")  # fresh Notes, filled by the resume
    for rank in (0, 1):
        assert resumed[rank]["summary"]["steps_this_run"] == 2
        assert resumed[rank]["restored"] == {
            "shared": [1, 2.5, "x"],
            "mine": f"notes of rank {rank}",
        }


def test_a_member_missing_from_the_checkpoint_starts_fresh_or_is_refused(tmp_path: Path) -> None:
    from helpers.inproc import train_ranks

    train_ranks(tmp_path, *COMMON, "trainer.max_steps=2")  # no Notes registered
    with pytest.raises(UserError, match=r"holds no note state, which this job needs"):
        _ranks(tmp_path, "trainer.max_steps=4", required=True)

    resumed = _ranks(tmp_path, "trainer.max_steps=4")
    assert resumed[0]["restored"] == {} and resumed[0]["summary"]["steps"] == 4
    assert "holds no note state: starting it fresh" in resumed.logs[0]
    assert "holds no my_note state for rank 1: starting it fresh" in resumed.logs[1]
