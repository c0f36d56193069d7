"""The GPU check's harness (scripts/bench/gpu_check.sh), on the CPU: the windows its
`sync_debug` run checks for host-device syncs (scripts/bench/sync_check.py) and that the
run ends with the check off, so that its final health check, evaluation and summary (which
read values back by design) do not raise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FAST
from helpers.inproc import train_here

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench"


@pytest.fixture
def sync_check(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import sync_check

    return sync_check


def test_sync_debug_arms_between_log_steps_only(sync_check):
    def armed(log_interval: int, max_steps: int) -> list[int]:
        debug = sync_check.SyncDebug(log_interval, max_steps)
        steps = []
        for step in range(1, max_steps + 1):
            if debug.armed:
                steps.append(step)
            change = debug.after_step(step)
            debug.armed = debug.armed if change is None else change
        assert not debug.armed, "armed after the last step: the final health check would raise"
        return steps

    assert armed(10, 30) == [*range(11, 20), *range(21, 30)]
    # A last interval cut short by max_steps is not checked: it ends in the final check.
    assert armed(10, 35) == [*range(11, 20), *range(21, 30)]
    assert armed(10, 10) == [] and armed(1, 5) == []
    assert len(armed(10, 200)) == 19 * 9


def test_sync_debug_run_ends_disarmed(tmp_path, sync_check, capsys):
    """A real run with the callback (no CUDA here: the schedule without the mode): it ends
    with exit 0 and the "sync check" line gpu_check.sh looks for."""
    summary = train_here(
        tmp_path, *FAST, "trainer.max_steps=30", "trainer.eval_interval=0",
        "trainer.ckpt_interval=0", "+callbacks.sync._target_=sync_check.SyncDebug",
        "+callbacks.sync.log_interval=${trainer.log_interval}",
        "+callbacks.sync.max_steps=${trainer.max_steps}",
    )  # fmt: skip
    assert summary["steps"] == 30
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("sync check:")]
    assert line and line[0].startswith("sync check: 18 steps ran with no host-device sync")
    assert "disarmed at the end: True" in line[0]
    stats = [json.loads(ln) for ln in (tmp_path / "stats" / "rank0.jsonl").read_text().splitlines()]
    assert [s.get("sync_free_steps") for s in stats if "sync_free_steps" in s] == [9, 18]
