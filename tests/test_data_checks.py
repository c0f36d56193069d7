"""Bad data fails on load, in one line naming the file, before any training step.

Each case writes a small synthetic data set with scripts/make_synthetic.py, breaks one shard
the way real data goes wrong (a shard of other width, float64, a label past the class count,
NaN in training or validation rows) and runs the training loop on it, in process: on one rank
here, or on 2 real gloo ranks (helpers/ranks.py). The header checks (shape, dtype) run in
SyntheticArrays' constructor, so with several ranks they fail on every rank before the process
group starts; the value checks (finite, label range) run on the rows each rank loads
(`data.check_loaded`). What the entry makes of such a UserError (exit 2, one `error:` line) is
checked end to end in tests/test_bad_input.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import FAST
from helpers.inproc import train_here, train_ranks

from hydra_ddp.data import Origin, Rows, TokenWindows, check_loaded
from hydra_ddp.errors import UserError

pytestmark = pytest.mark.timeout(300)

RUN = [*FAST, "data=synthetic", "trainer.max_steps=3", "trainer.batch_size=16"]
DATA = ["--rows", "256", "--shards", "2", "--features", "64", "--eval-rows", "32"]


def _failed_on(job: Path, *overrides: str) -> str:
    """The one-line UserError of a one-rank run of RUN + overrides; nothing was trained."""
    with pytest.raises(UserError) as info:
        train_here(job, *RUN, *overrides)
    message = str(info.value)
    assert "\n" not in message and len(message) < 800, message
    assert not (job / "summary.json").exists() and not list(job.rglob("*.pt"))
    return message


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
    line = _failed_on(tmp_path / "job", f"data.path={data}")
    for want in (str(data / "train_00001.x.npy"), "(128, 32)", "64 features"):
        assert want in line, line


def test_float64_shard_is_refused_before_the_process_group(tmp_path: Path, synthetic) -> None:
    """2 gloo ranks: each rank's constructor reads the headers and fails before
    init_process_group, in one line naming the shard."""
    data = synthetic("syn", *DATA)
    x = np.load(data / "train_00000.x.npy")
    np.save(data / "train_00000.x.npy", x.astype(np.float64))
    done = train_ranks(tmp_path / "job", *RUN, f"data.path={data}", return_exceptions=True)
    for rank, error in enumerate(done):
        assert isinstance(error, UserError), error
        line = str(error)
        assert "\n" not in line and str(data / "train_00000.x.npy") in line and "float64" in line
        assert "not float32" in line and "astype(np.float32)" in line
        assert "process group up" not in done.logs[rank], done.logs[rank]


def test_label_outside_the_class_count_names_file_and_row(tmp_path: Path, synthetic) -> None:
    data = synthetic("syn", *DATA)
    _poke(data / "train_00001.y.npy", 7, 10, column=None)  # 10 classes: ids 0..9
    line = _failed_on(tmp_path / "job", f"data.path={data}")
    for want in (str(data / "train_00001.y.npy"), "row 7", "class id 10", "0..9"):
        assert want in line, line


def test_nan_in_training_rows_names_file_and_row(tmp_path: Path, synthetic) -> None:
    data = synthetic("syn", *DATA)
    _poke(data / "train_00000.x.npy", 5, np.nan)
    _poke(data / "train_00000.x.npy", 9, np.inf)
    line = _failed_on(tmp_path / "job", f"data.path={data}")
    for want in (str(data / "train_00000.x.npy"), "row 5 has NaN", "1 more row"):
        assert want in line, line


def test_nan_in_validation_rows_fails_instead_of_a_nan_summary(tmp_path: Path, synthetic) -> None:
    data = synthetic("syn", *DATA)
    _poke(data / "val_00000.x.npy", 30, np.nan)
    line = _failed_on(tmp_path / "job", f"data.path={data}")
    for want in (str(data / "val_00000.x.npy"), "(val split)", "row 30 has NaN"):
        assert want in line, line


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


def test_a_data_path_that_is_a_symlink_loop_says_so(tmp_path: Path) -> None:
    from hydra_ddp.data import SyntheticArrays

    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(UserError, match=r"data.path=.*/a is a symlink loop"):
        SyntheticArrays(str(tmp_path / "a"), in_memory=False)
