"""Bad data fails on load, in one line naming the file, before any training step.

Each case writes a small synthetic data set with scripts/make_synthetic.py, breaks one shard
the way real data goes wrong (a shard of other width, float64, a label past the class count,
NaN in training or validation rows) and runs the real entry point. The header checks
(shape, dtype) run in SyntheticArrays' constructor, so under torchrun they fail on every rank
before the process group starts; the value checks (finite, label range) run on the rows each
rank loads (`data.check_loaded`).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import FAST, python_train, torchrun

from hydra_ddp.data import Origin, Rows, TokenWindows, check_loaded
from hydra_ddp.errors import UserError

pytestmark = pytest.mark.timeout(300)

RUN = [*FAST, "data=synthetic", "trainer.max_steps=3", "trainer.batch_size=16"]
DATA = ["--rows", "256", "--shards", "2", "--features", "64", "--eval-rows", "32"]


def _failed_on(proc: subprocess.CompletedProcess[str], *wants: str) -> str:
    """Exit 2, no traceback, and one `error:` line holding every string in `wants`."""
    out = proc.stdout + proc.stderr
    report = f"exit {proc.returncode}\n--- output\n{out[-5000:]}"
    assert proc.returncode == 2, report
    assert "Traceback" not in out, report
    errors = [ln for ln in out.splitlines() if "error:" in ln]
    assert len(errors) == 1, report
    for want in wants:
        assert want in errors[0], f"missing {want!r}\n{report}"
    assert len(errors[0]) < 800, report
    return errors[0]


def _poke(path: Path, row: int, value: float, column: int | None = 0) -> None:
    arr = np.load(path, mmap_mode="r+")
    if column is None:
        arr[row] = value
    else:
        arr[row, column] = value
    arr.flush()
    del arr


def test_shard_with_other_feature_count_names_the_shard(tmp_path: Path, synthetic) -> None:
    data = synthetic("syn", *DATA)
    np.save(data / "train_00001.x.npy", np.zeros((128, 32), dtype=np.float32))
    proc = python_train(tmp_path, *RUN, f"data.path={data}")
    _failed_on(proc, str(data / "train_00001.x.npy"), "(128, 32)", "64 features")


def test_float64_shard_is_refused_before_the_process_group(tmp_path: Path, synthetic) -> None:
    """Real torchrun, 2 ranks: each rank's constructor reads the headers and fails before
    init_process_group; the worker's error is ours, in one line per rank."""
    data = synthetic("syn", *DATA)
    x = np.load(data / "train_00000.x.npy")
    np.save(data / "train_00000.x.npy", x.astype(np.float64))
    proc = torchrun(tmp_path, *RUN, f"data.path={data}", nproc=2)
    out = proc.stdout + proc.stderr
    assert "process group up" not in out, out[-4000:]
    # torchrun itself exits 1 for a failed worker; the workers exited with our code 2.
    assert proc.returncode != 0 and "exitcode  : 2" in out, out[-4000:]
    errors = [ln for ln in out.splitlines() if "error:" in ln]
    assert 1 <= len(errors) <= 2, out[-4000:]
    assert all(str(data / "train_00000.x.npy") in ln and "float64" in ln for ln in errors)
    assert all("not float32" in ln and "astype(np.float32)" in ln for ln in errors)
    # torchrun adds a ChildFailedError report of its own for a failed worker; no frame of
    # it, nor any other traceback, is ours.
    assert out.count("Traceback") <= 1, out[-4000:]
    if "Traceback" in out:
        assert "ChildFailedError" in out and "hydra_ddp/" not in out[out.index("Traceback") :]


def test_label_outside_the_class_count_names_file_and_row(tmp_path: Path, synthetic) -> None:
    data = synthetic("syn", *DATA)
    _poke(data / "train_00001.y.npy", 7, 10, column=None)  # 10 classes: ids 0..9
    proc = python_train(tmp_path, *RUN, f"data.path={data}")
    _failed_on(proc, str(data / "train_00001.y.npy"), "row 7", "class id 10", "0..9")


def test_nan_in_training_rows_names_file_and_row(tmp_path: Path, synthetic) -> None:
    data = synthetic("syn", *DATA)
    _poke(data / "train_00000.x.npy", 5, np.nan)
    _poke(data / "train_00000.x.npy", 9, np.inf)
    proc = python_train(tmp_path, *RUN, f"data.path={data}")
    _failed_on(proc, str(data / "train_00000.x.npy"), "row 5 has NaN", "1 more row")
    assert not list(tmp_path.glob("outputs/*/*/summary.json"))


def test_nan_in_validation_rows_fails_instead_of_a_nan_summary(tmp_path: Path, synthetic) -> None:
    data = synthetic("syn", *DATA)
    _poke(data / "val_00000.x.npy", 30, np.nan)
    proc = python_train(tmp_path, *RUN, f"data.path={data}")
    _failed_on(proc, str(data / "val_00000.x.npy"), "(val split)", "row 30 has NaN")
    assert not list(tmp_path.glob("outputs/*/*/summary.json"))


# --------------------------------------------------------------------------------------------
# The generic check, which a source of a user's own gets through TrainData / EvalData
# --------------------------------------------------------------------------------------------


def test_check_loaded_on_a_users_rows() -> None:
    x = np.ones((10, 3), dtype=np.float32)
    y = np.arange(10, dtype=np.int64) % 4
    check_loaded(Rows([x, x], [y, y]), {"out_features": 4}, "train")  # fine
    with pytest.raises(UserError, match=r"y segment 1 row 3 has class id 4, outside 0\.\.3"):
        check_loaded(Rows([x, x], [y, y + 1]), {"out_features": 4}, "train")
    bad = x.copy()
    bad[2, 1] = -np.inf
    with pytest.raises(UserError, match=r"\(val split\): my.x row 12 has -inf in its features"):
        check_loaded(Rows([bad], [y], [Origin("my.x", "my.y", 10)]), {}, "val")
    target = np.zeros((10, 1), dtype=np.float32)
    target[4] = np.nan
    with pytest.raises(UserError, match="row 4 has NaN in its targets"):
        check_loaded(Rows([x], [target]), {"out_features": 1}, "train")
    with pytest.raises(UserError, match="every part of a split needs the same row shape"):
        Rows([x, x.astype(np.float64)], [y, y])
    tokens = np.array([0, 1, 2, 99, 1], dtype=np.int64)
    with pytest.raises(UserError, match="position 3 has token id 99"):
        check_loaded(TokenWindows([tokens], 2), {"vocab_size": 3}, "train")
