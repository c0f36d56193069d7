"""Files that are not what they seem: a data shard, a manifest or a checkpoint that is a FIFO,
a socket or a device; text or random bytes as `trainer.init_from`; a checkpoint write past the
file-size limit. Each is refused in one line naming the file, and nothing waits without a
bound (a FIFO blocks whoever opens it until a writer comes)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hydra_ddp import checkpoint
from hydra_ddp.data import SyntheticArrays
from hydra_ddp.errors import UserError

pytestmark = pytest.mark.timeout(60)  # before the fix, the FIFO cases hung for ever


def _first_shard(root: Path) -> Path:
    meta = json.loads((root / "manifest.json").read_text())
    return root / meta["splits"]["train"][0]["x"]


@pytest.mark.parametrize("kind", ["fifo", "socket", "device"])
def test_a_data_shard_that_is_not_a_regular_file_is_refused(
    tmp_path: Path, synthetic, kind: str
) -> None:
    """Previously: a shard that is a FIFO blocked the job in np.load before any timeout
    applied, printing nothing."""
    root = synthetic()
    shard = _first_shard(root)
    shard.unlink()
    if kind == "fifo":
        os.mkfifo(shard)
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(shard))
    else:
        shard.symlink_to("/dev/zero")
    words = {"fifo": "a FIFO (named pipe)", "socket": "a socket", "device": "a device"}[kind]
    with pytest.raises(UserError) as e:
        SyntheticArrays(str(root), in_memory=False)
    assert str(e.value).startswith(f"data file {shard} is {words}, not a regular file"), e.value
    assert "\n" not in str(e.value)


def test_a_manifest_that_is_a_fifo_is_refused(tmp_path: Path, synthetic) -> None:
    root = synthetic()
    (root / "manifest.json").unlink()
    os.mkfifo(root / "manifest.json")
    with pytest.raises(UserError, match=r"manifest.json is a FIFO \(named pipe\), not a regular"):
        SyntheticArrays(str(root), in_memory=False)


@pytest.mark.parametrize("content", ["text", "random", "fifo"])
def test_init_from_that_is_not_a_checkpoint_says_so_for_init_from(
    tmp_path: Path, content: str
) -> None:
    """Previously: a text file as trainer.init_from gave `not a readable checkpoint (101)` and
    advice about trainer.resume; a FIFO hung."""
    path = tmp_path / "weights.pt"
    if content == "text":
        path.write_text("these are not weights\n")
    elif content == "random":
        path.write_bytes(os.urandom(4096))
    else:
        os.mkfifo(path)
    with pytest.raises(UserError) as e:
        checkpoint.init_weights(torch.nn.Linear(2, 2), str(path), strict=True)
    line = str(e.value)
    assert "trainer.init_from" in line and "trainer.resume" not in line and "\n" not in line
    if content == "fifo":
        assert "is a FIFO (named pipe)" in line, line
    else:
        assert "not a torch.save archive" in line and "(101)" not in line, line


def test_a_checkpoint_write_past_the_file_size_limit_says_file_too_large(tmp_path: Path) -> None:
    """Previously: `[enforce fail at inline_container.cc...]`, never "file too large". The
    limit (`ulimit -f`) is set in a child process, so this one keeps its own."""
    code = (
        "import resource, sys, torch\n"
        "from hydra_ddp import checkpoint\n"
        "from hydra_ddp.errors import UserError\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))\n"
        "try:\n"
        f"    checkpoint.save({{'model': {{'w': torch.ones(1 << 20)}}}}, {str(tmp_path)!r}, 1, 2)\n"
        "except UserError as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "file too large" in done.stdout and "step_00000001.pt" in done.stdout, (
        done.stdout + done.stderr
    )
    assert "ulimit -f" in done.stdout and "enforce fail" not in done.stdout
    assert not list((tmp_path / "checkpoints").iterdir())  # no half-written file left
