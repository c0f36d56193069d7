"""Files that are not what they seem: a data shard, a manifest or a checkpoint that is a FIFO,
a socket or a device; text or random bytes as `trainer.init_from`; a checkpoint write past the
file-size limit. Each is refused in one line naming the file, and nothing waits without a
bound (a FIFO blocks whoever opens it until a writer comes)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FAST, run, wandb_env
from helpers.inproc import compose, isolated, train_here
from omegaconf import OmegaConf

from hydra_ddp import checkpoint
from hydra_ddp.checkpoint.init_from import for_fresh_run
from hydra_ddp.data import SyntheticArrays
from hydra_ddp.distributed.failures import worker_failed
from hydra_ddp.errors import UserError
from hydra_ddp.eval import main as evaluate_main
from hydra_ddp.export.writer import main as export_main
from hydra_ddp.rundir import claim, paths

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
        for_fresh_run(torch.nn.Linear(2, 2), str(path), None)
    line = str(e.value)
    assert "trainer.init_from" in line and "trainer.resume" not in line and "\n" not in line
    if content == "fifo":
        assert "is a FIFO (named pipe)" in line, line
    else:
        assert "not a torch.save archive" in line and "(101)" not in line, line


@pytest.mark.slow
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


# --------------------------------------------------------------------------------------------
# A FIFO among the files of a run dir: each reader refuses it in one line, none waits
# --------------------------------------------------------------------------------------------

RUN = [*FAST, "trainer.max_steps=4", "trainer.ckpt_interval=2", "trainer.batch_size=16"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4 and its .hydra/config.yaml."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    train_here(run_dir, *RUN)
    (run_dir / ".hydra").mkdir()
    OmegaConf.save(compose(*RUN), run_dir / ".hydra" / "config.yaml")
    return run_dir


@pytest.fixture
def run_dir(trained: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def _fifo(path: Path) -> Path:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def _line(info: pytest.ExceptionInfo) -> str:
    message = str(info.value)
    assert "\n" not in message and "is a FIFO (named pipe), not a regular file" in message, message
    return message


def test_a_fifo_checkpoint_is_refused_by_resume_init_from_eval_and_export(
    run_dir: Path, tmp_path: Path, caplog
) -> None:
    """Previously: each of the four waited for ever in zipfile.is_zipfile (checkpoint.latest
    looks at the newest step file first), the claim's heartbeat keeping the dir locked."""
    fifo = _fifo(run_dir / "checkpoints" / "step_00000005.pt")
    with pytest.raises(UserError) as info:
        train_here(run_dir, *RUN[:-3], "trainer.max_steps=8")
    assert f"checkpoint {fifo} is a FIFO" in _line(info) and "remove it" in _line(info)
    with pytest.raises(UserError) as info:
        train_here(tmp_path / "other", *RUN, f"trainer.init_from={run_dir}")
    assert str(fifo) in _line(info)
    assert not (tmp_path / "other" / "checkpoints").exists()
    for entry in (evaluate_main, export_main):
        caplog.clear()
        with isolated(), pytest.raises(SystemExit) as done:
            entry([f"run={run_dir}"])
        assert done.value.code == 2
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert len(errors) == 1 and str(fifo) in errors[0] and "FIFO" in errors[0], errors
    fifo.unlink()  # the run is whole again: nothing was written or moved by the refusals
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "best.pt",
        "step_00000002.pt",
        "step_00000004.pt",
    ]


def test_eval_of_a_fifo_names_its_own_key_ckpt(run_dir: Path, caplog) -> None:
    """Previously: the line told the user of `python -m hydra_ddp.eval` to point
    trainer.resume elsewhere; eval's key is ckpt=."""
    fifo = _fifo(run_dir / "weights.pt")
    with isolated(), pytest.raises(SystemExit) as done:
        evaluate_main([f"run={run_dir}", f"ckpt={fifo}"])
    assert done.value.code == 2
    line = next(r.getMessage() for r in caplog.records if r.levelname == "ERROR")
    assert "FIFO" in line and "ckpt" in line and "trainer.resume" not in line, line


@pytest.mark.parametrize(
    ("name", "steps"), [("stats/rank0.jsonl", 6), ("summary.json", 4), ("wandb_ids.json", 6)]
)
def test_a_fifo_among_the_runs_own_files_is_refused_on_resume(
    run_dir: Path, tmp_path: Path, monkeypatch, name: str, steps: int
) -> None:
    """Previously: a resume opened each of them and waited for ever (the stats files to drop
    the rows past the checkpoint; summary.json, when the run is re-run as it was, to say it is
    finished; wandb_ids.json with W&B, to reopen its runs)."""
    fifo = _fifo(run_dir / name)
    more = [f"trainer.max_steps={steps}"]
    if name == "wandb_ids.json":
        for key, value in wandb_env(tmp_path, WANDB_MODE="offline").items():
            monkeypatch.setenv(key, value)
        more.append("logger=wandb")
    with pytest.raises(UserError) as info:
        train_here(run_dir, *RUN[:-3], "trainer.batch_size=16", *more)
    assert str(fifo) in _line(info)


def test_a_fifo_as_the_claim_the_log_or_a_ranks_error_record_does_not_block(
    tmp_path: Path, capsys
) -> None:
    """The files the entry and the launcher open before any rank trains: `.claim` (read to name
    the job holding the dir), the log file, and errors/rank<r>.txt (read to name the failed
    rank). Previously each open waited for ever."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _fifo(run_dir / ".claim")
    with pytest.raises(SystemExit) as done:
        claim.claim(run_dir)
    assert done.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: the claim file") and "FIFO" in line and "\n" not in line
    (run_dir / ".claim").unlink()
    _fifo(run_dir / "train.log")
    try:
        with pytest.raises(SystemExit) as done:
            paths.log_file(str(run_dir), "train")
    finally:
        claim.release_all()
    assert done.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"error: log file {run_dir / 'train.log'} is a FIFO"), line
    errors_dir = run_dir / "errors"
    errors_dir.mkdir()
    _fifo(errors_dir / "rank0.txt")
    (errors_dir / "rank1.txt").write_text("rank 1 said why\n")
    # An empty record (a full disk once left one) is no cause, though it came first.
    (errors_dir / "rank2.txt").write_text("")
    os.utime(errors_dir / "rank2.txt", (1, 1))
    said = str(worker_failed({0: 1, 1: 2, 2: 1}, errors_dir, run_dir))
    assert "worker rank 1 failed: rank 1 said why" in said, said


@pytest.mark.slow  # three real entry points, ~30 s on 2 cores
@pytest.mark.timeout(300)
def test_the_entries_refuse_a_fifo_checkpoint_in_one_line_and_give_the_dir_back(
    run_dir: Path, tmp_path: Path
) -> None:
    """What a user typed: `python -m hydra_ddp.train` resuming, `hydra_ddp.eval` and
    `hydra_ddp.export` each end in one `error:` line, exit 2, and leave no claim behind."""
    fifo = _fifo(run_dir / "checkpoints" / "step_00000005.pt")
    train = [*RUN[:-3], "trainer.max_steps=8", "trainer.batch_size=16", f"hydra.run.dir={run_dir}"]
    for module, args in (
        ("hydra_ddp.train", train),
        ("hydra_ddp.eval", [f"run={run_dir}"]),
        ("hydra_ddp.export", [f"run={run_dir}"]),
    ):
        done = run([sys.executable, "-m", module, *args], tmp_path, timeout=120)
        errors = [ln for ln in done.stderr.splitlines() if "error:" in ln]
        assert done.returncode == 2 and len(errors) == 1, (module, done.stderr[-3000:])
        assert f"{fifo} is a FIFO" in errors[0] and "Traceback" not in done.stderr, errors
        assert not (run_dir / ".claim").exists()


def test_a_fifo_inside_a_sharded_checkpoint_folder_is_refused(tmp_path: Path) -> None:
    """A ddp=fsdp2 checkpoint folder whose manifest lists a file that is a FIFO is refused
    naming it, as a step file that is one. Previously it was skipped as "missing" (the check
    of the folder, which reads every listed file before DCP's reader does, saw no file)."""
    folder = tmp_path / "checkpoints" / "step_00000002.dcp"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"files": {".metadata": [10, 0]}}))
    fifo = _fifo(folder / ".metadata")
    with pytest.raises(UserError) as info:
        checkpoint.latest(tmp_path)
    assert f"checkpoint file {fifo} is a FIFO" in _line(info)
