"""Nothing lost to a bad file or a re-run (issue "Lose nothing"), through the real entry point.

Each case was reproduced on the previous main, as its docstring says, and fails there:
* a corrupt newest checkpoint (256 bytes flipped inside a tensor member) resumed silently;
* `checkpoints` that is a file: a silent fresh start, then FileExistsError at the first save;
* re-running a finished run trained 0 steps and exited as if it had trained.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
from conftest import FAST, ok, python_train

pytestmark = pytest.mark.timeout(300)

SHORT = [*FAST, "trainer.max_steps=6", "trainer.ckpt_interval=3", "trainer.batch_size=16"]


def _flip_inside_a_tensor(path: Path) -> None:
    """Flip 256 bytes in the middle of the largest member (a tensor's storage), leaving the zip
    structure intact, so only the member CRCs can tell."""
    with zipfile.ZipFile(path) as archive:
        info = max(archive.infolist(), key=lambda i: i.file_size)
    blob = bytearray(path.read_bytes())
    header = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    start = header + info.compress_size // 2
    blob[start : start + 256] = bytes(b ^ 0xFF for b in blob[start : start + 256])
    path.write_bytes(bytes(blob))


def test_corrupt_newest_checkpoint_is_skipped_and_the_previous_one_used(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ok(python_train(tmp_path, *SHORT, f"hydra.run.dir={run_dir}"))
    newest = run_dir / "checkpoints" / "step_00000006.pt"
    assert zipfile.is_zipfile(newest)
    _flip_inside_a_tensor(newest)
    assert zipfile.is_zipfile(newest)  # what the previous check looked at: still "fine"

    proc = ok(
        python_train(
            tmp_path,
            *SHORT[:-2],
            "trainer.max_steps=9",
            "trainer.batch_size=16",
            f"hydra.run.dir={run_dir}",
        )
    )
    out = proc.stderr
    assert "skipping" in out and "step_00000006.pt" in out and "CRC" in out, out[-3000:]
    assert "resumed from" in out and "step_00000003.pt at step 3" in out, out[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps"] == 9 and s["steps_this_run"] == 6

    # Named directly, the corrupt file is refused in one line.
    bad = python_train(
        tmp_path, *SHORT, f"trainer.resume={newest}", f"hydra.run.dir={tmp_path / 'other'}"
    )
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert "step_00000006.pt is not a readable checkpoint" in bad.stderr and "CRC" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_checkpoints_that_is_a_file_fails_before_training(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("not a folder\n")
    proc = python_train(tmp_path, *SHORT, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "checkpoints exists but is not a directory" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (run_dir / "stats").exists()  # nothing trained
    assert (run_dir / "checkpoints").read_text() == "not a folder\n"


def test_rerunning_a_finished_run_says_so_and_changes_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ok(python_train(tmp_path, *SHORT, f"hydra.run.dir={run_dir}"))
    before = (run_dir / "summary.json").read_text()
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    proc = ok(python_train(tmp_path, *SHORT, f"hydra.run.dir={run_dir}"))
    assert "already complete at step 6 of 6: nothing to do" in proc.stderr, proc.stderr[-2000:]
    assert "trainer.resume=never" in proc.stderr
    assert (run_dir / "summary.json").read_text() == before
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ckpts
