"""Nothing lost to a bad file or a re-run (issue "Lose nothing").

Each case was reproduced on the previous main, as its docstring says, and fails there:
* a corrupt newest checkpoint (256 bytes flipped inside a tensor member) resumed silently;
* `checkpoints` that is a file: a silent fresh start, then FileExistsError at the first save;
* re-running a finished run trained 0 steps and exited as if it had trained.

The runs are the training loop on one rank in this process (helpers/inproc.py); what the entry
makes of the UserErrors (exit 2, one `error:` line) is checked end to end in
tests/test_bad_input.py, which also runs the refused resume that must keep the earlier run's
`.hydra/` record through the real CLI.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import FAST, ok, python_train, run, start_logged, user_env
from helpers.inproc import train_here, train_ranks
from omegaconf import OmegaConf

from hydra_ddp import checkpoint
from hydra_ddp.distributed.failures import LOST_CONTACT, worker_failed
from hydra_ddp.errors import UserError
from hydra_ddp.launch import command as overrides
from hydra_ddp.rundir import sweeps

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
import plot_run  # noqa: E402  (scripts/plot_run.py: what reads the stats files back)

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


def _one_line(info: pytest.ExceptionInfo) -> str:
    message = str(info.value)
    assert "\n" not in message and len(message) < 800, message
    return message


def test_corrupt_newest_checkpoint_is_skipped_and_the_previous_one_used(
    tmp_path: Path, caplog
) -> None:
    caplog.set_level(logging.INFO)
    run_dir = tmp_path / "run"
    train_here(run_dir, *SHORT)
    newest = run_dir / "checkpoints" / "step_00000006.pt"
    assert zipfile.is_zipfile(newest)
    _flip_inside_a_tensor(newest)
    assert zipfile.is_zipfile(newest)  # what the previous check looked at: still "fine"

    caplog.clear()
    s = train_here(run_dir, *SHORT[:-2], "trainer.max_steps=9", "trainer.batch_size=16")
    out = caplog.text
    assert "skipping" in out and "step_00000006.pt" in out and "CRC" in out, out[-3000:]
    assert "resumed from" in out and "step_00000003.pt at step 3" in out, out[-3000:]
    assert s["steps"] == 9 and s["steps_this_run"] == 6
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 9

    # Named directly, the corrupt file is refused in one line.
    with pytest.raises(UserError) as info:
        train_here(tmp_path / "other", *SHORT, f"trainer.resume={newest}")
    line = _one_line(info)
    assert "step_00000006.pt is not a readable checkpoint" in line and "CRC" in line


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_a_checkpoint_that_cannot_resume_is_refused_and_the_run_keeps_its_checkpoints(
    tmp_path: Path,
) -> None:
    """A re-run in a dir whose checkpoints cannot be resumed: one line naming trainer.resume and
    the fix, and the checkpoints as they were (the entry exits 2 for a UserError:
    test_bad_input.py). Previously, with every checkpoint truncated (a copy cut short), resume
    warned twice and trained from scratch, its saves replacing and rotating away the run's
    checkpoints, exit 0."""
    run_dir = tmp_path / "run"
    train_here(run_dir, *SHORT)
    folder = run_dir / "checkpoints"
    longer = [*SHORT[:-2], "trainer.max_steps=9", "trainer.batch_size=16"]
    before = _digests(folder)
    with pytest.raises(UserError) as info:  # a checkpoint of another model
        train_here(run_dir, *longer, "model.hidden=64")
    line = _one_line(info)
    assert "step_00000006.pt is a checkpoint of a different model (size mismatch" in line, line
    assert ".hydra/config.yaml" in line and "trainer.resume=never" in line
    assert _digests(folder) == before

    for path in folder.glob("step_*.pt"):  # every one truncated
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    before = _digests(folder)
    with pytest.raises(UserError) as info:
        train_here(run_dir, *longer)
    line = _one_line(info)
    assert "trainer.resume=auto: no checkpoint in" in line and "step_00000006.pt" in line, line
    assert "not a torch.save archive" in line and "trainer.resume=never" in line
    assert _digests(folder) == before
    # Named, a truncated one is refused the same way.
    with pytest.raises(UserError) as info:
        train_here(run_dir, *longer, f"trainer.resume={folder / 'step_00000003.pt'}")
    assert "step_00000003.pt is not a readable checkpoint (not a torch.save" in _one_line(info)
    # trainer.resume=never starts over, with the damaged checkpoints set aside, not deleted.
    assert train_here(run_dir, *longer, "trainer.resume=never")["steps_this_run"] == 9
    assert _digests(run_dir / "checkpoints.before-1") == before


@pytest.mark.slow  # two real commands at once, ~35 s on 2 cores
def test_eval_while_a_resume_rotates_the_checkpoint_it_reads(tmp_path: Path) -> None:
    """`python -m hydra_ddp.eval run=<dir>` while `python -m hydra_ddp.train` resumes in <dir>,
    saving every step and keeping one checkpoint, so each newest one is removed a step after it
    is written: every evaluation succeeds, and the resume goes on until it is stopped, with its
    checkpoint. Previously eval failed in one line, saying the checkpoint it had picked "may be
    truncated or corrupt": the resume had removed it between eval's pick and its read (eval
    builds the data and the model in between)."""
    run_dir = tmp_path / "run"
    job = [*FAST, "trainer.batch_size=16", "trainer.ckpt_interval=1", "trainer.keep_ckpts=1",
           "trainer.eval_interval=0", f"hydra.run.dir={run_dir}"]  # fmt: skip
    ok(python_train(tmp_path, *job, "trainer.max_steps=2"))
    train, console = start_logged(
        [sys.executable, "-m", "hydra_ddp.train", *job, "trainer.max_steps=100000"], tmp_path
    )
    try:
        deadline = time.monotonic() + 120
        while (newest := checkpoint.latest(run_dir)) is None or newest.name < "step_00000005":
            assert train.poll() is None and time.monotonic() < deadline, console.read_text()
            time.sleep(0.2)
        for _ in range(2):
            done = run([sys.executable, "-m", "hydra_ddp.eval", f"run={run_dir}"], tmp_path)
            assert done.returncode == 0, done.stderr[-3000:]
            result = json.loads((run_dir / "eval_test.json").read_text())
            assert result["step"] > 2 and math.isfinite(result["loss"]), result
            assert train.poll() is None, console.read_text()[-3000:]
        train.send_signal(signal.SIGTERM)
        assert train.wait(timeout=60) == 143, console.read_text()[-3000:]
    finally:
        if train.poll() is None:
            train.kill()
    stopped = re.search(
        r"stopped on SIGTERM at step (\d+) of 100000 with a checkpoint", console.read_text()
    )
    assert stopped, console.read_text()[-3000:]
    assert checkpoint.latest(run_dir).name == f"step_{int(stopped.group(1)):08d}.pt"
    assert checkpoint.load(checkpoint.latest(run_dir))["step"] == int(stopped.group(1))


def test_checkpoints_that_is_a_file_fails_before_training(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("not a folder\n")
    with pytest.raises(UserError) as info:
        train_here(run_dir, *SHORT)
    assert "checkpoints exists but is not a directory" in _one_line(info)
    assert not (run_dir / "stats").exists()  # nothing trained
    assert (run_dir / "checkpoints").read_text() == "not a folder\n"


def test_a_killed_writers_half_written_checkpoints_go_at_the_next_save(tmp_path: Path) -> None:
    """A rank 0 killed while writing a step checkpoint or best.pt leaves its temporary file (as
    large as a checkpoint); the next run's first save removes both, and nothing else."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    dead_pid = 2**22 + 1  # above Linux's pid_max: no live writer has it
    left = [folder / f".step_00000002.pt.{dead_pid}.tmp", folder / f".best.pt.{dead_pid}.tmp"]
    for p in left:
        p.write_bytes(b"half a checkpoint")
    (folder / "notes.txt").write_text("mine\n")
    checkpoint.save({"model": {}, "step": 4}, tmp_path, 4, keep=3)
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt", "step_00000004.pt"]
    assert checkpoint.load(folder / "step_00000004.pt")["step"] == 4


def test_rerunning_a_finished_run_says_so_and_changes_nothing(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO)
    run_dir = tmp_path / "run"
    train_here(run_dir, *SHORT)
    before = (run_dir / "summary.json").read_text()
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    caplog.clear()
    s = train_here(run_dir, *SHORT)
    assert "already complete at step 6 of 6: nothing to do" in caplog.text, caplog.text[-2000:]
    assert "trainer.resume=never" in caplog.text
    assert s == json.loads(before)
    assert (run_dir / "summary.json").read_text() == before
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ckpts


@pytest.mark.slow  # two real launches at once; the dir claim itself is in test_launch.py
def test_two_jobs_started_in_the_same_second_get_their_own_dirs(tmp_path: Path) -> None:
    """Previously: two jobs started in the same second from the same folder shared one output
    dir (`.hydra/` of one, summary and checkpoints of the other, both exit 0). The clash is
    forced here instead of waited for: both resolve the default dir to the same path, as
    `outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}` does within one second. One job is self-launched
    with 2 ranks, the other is a torchrun job: both ways of deciding the dir are covered."""
    same = "hydra.run.dir=${ddp_job_dir:outputs/same}"
    jobs = {
        "1": [sys.executable, "-m", "hydra_ddp.train", "dist.nproc_per_node=2"],
        "2": [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        + ["--nproc_per_node=2", "-m", "hydra_ddp.train"],
    }
    procs = {
        seed: subprocess.Popen(
            [*cmd, *SHORT, f"trainer.seed={seed}", same],
            cwd=tmp_path,
            env=user_env(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for seed, cmd in jobs.items()
    }
    for proc in procs.values():
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out[-4000:]
    dirs = sorted(p.name for p in (tmp_path / "outputs").iterdir())
    assert dirs == ["same", "same-2"], dirs
    seeds = set()
    for name in dirs:
        job = tmp_path / "outputs" / name
        seed = str(yaml.safe_load((job / ".hydra" / "config.yaml").read_text())["trainer"]["seed"])
        seeds.add(seed)
        # Each dir holds one job's record and that job's results: nothing mixed.
        assert f"trainer.seed={seed}" in (job / ".hydra" / "overrides.yaml").read_text()
        assert json.loads((job / "summary.json").read_text())["steps"] == 6
        assert sorted(p.name for p in (job / "checkpoints").glob("step_*.pt")) == [
            "step_00000003.pt",
            "step_00000006.pt",
        ]
        assert sorted(p.name for p in (job / "stats").glob("rank*.jsonl")) == [
            "rank0.jsonl",
            "rank1.jsonl",
        ]
    assert seeds == {"1", "2"}


@pytest.mark.slow  # tens of seconds of 2-rank jobs: run by .ci/run after the default suite
def test_resume_on_more_ranks_maps_the_position(tmp_path: Path) -> None:
    """Previously: a 2-rank checkpoint at epoch 0 batch 12 resumed with 3 ranks crashed on every
    rank with `ValueError: start_batch=12 exceeds the 9 batches per epoch`, though the docs said
    a different world size works with a warning. 2 ranks x 48 of digits' 1257 training rows is
    14 batches per epoch; 3 ranks make it 9."""
    run_dir = tmp_path / "run"
    two = [*FAST, "trainer.batch_size=48", f"hydra.run.dir={run_dir}"]
    ok(python_train(tmp_path, "dist.nproc_per_node=2", *two, "trainer.max_steps=12"))
    proc = ok(python_train(tmp_path, "dist.nproc_per_node=3", *two, "trainer.max_steps=20"))
    out = proc.stderr + "".join(p.read_text() for p in run_dir.glob("train_rank*.log"))
    assert (
        "counted batches of 48 rows on 2 rank(s), this job 48 on 3: epoch 0 continues at its "
        "row 1152 (batch 8 here), exactly"
    ) in out
    assert "at step 12 (epoch 0, batch 8)" in out, out[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps"] == 20 and s["steps_this_run"] == 8 and s["world_size"] == 3
    # 8 batches of epoch 0 done at the resume, 8 more steps: epoch 1, batch 7 of 9.
    assert s["epochs"] == pytest.approx(1 + 7 / 9)


# --------------------------------------------------------------------------------------------
# A full disk and a read-only one: one line, nothing written before lost
# --------------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path):
    """A tmpfs of a few MiB under tmp_path (needs root, as in CI's container)."""
    disks: list[Path] = []

    def mount(name: str, size: str, read_only_dirs: tuple[str, ...] = ()) -> Path:
        disk = tmp_path / name
        disk.mkdir()
        made = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
            capture_output=True,
            text=True,
        )
        if made.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip()})")
        disks.append(disk)
        for d in read_only_dirs:
            (disk / d).mkdir()
        if read_only_dirs:
            subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        return disk

    yield mount
    for disk in disks:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.parametrize(
    "wrapper",
    [
        "default",
        pytest.param("fsdp2", marks=pytest.mark.slow),  # 2 ranks, 25 s
        pytest.param("fsdp2_async", marks=pytest.mark.slow),  # the save in the background
    ],
)
def test_a_disk_that_fills_up_says_no_space_and_gives_the_space_back(
    tmp_path: Path, small_disk, wrapper: str
) -> None:
    """A real ENOSPC, through the real writers, with space left after the failed write (the
    case the free-space guess missed). Previously, under DDP: `unexpected pos 263744 vs
    263664` (torch.save's message; the OSError was only its context); under fsdp2: DCP's
    CheckpointException (no Exception) got past every handler, a traceback from each rank,
    an empty errors/rank0.txt and the .step_N.dcp.tmp folder left filling the disk. (Before
    these, on a 4 MiB disk, ENOSPC gave 3-5 tracebacks and no `error:` line.)

    A checkpoint is ~2.6 MiB: steps 2 and 4 fit on the 8 MiB disk, step 6 does not."""
    disk = small_disk("full", "8m")
    run_dir = disk / "run"
    (run_dir / "errors").mkdir(parents=True)  # as the launcher makes it: each rank's cause
    job = [*FAST, "model.hidden=512", "model.depth=2", "trainer.max_steps=8",
           "trainer.ckpt_interval=2", "trainer.keep_ckpts=3",
           f"ddp={wrapper.removesuffix('_async')}"]  # fmt: skip
    if wrapper == "fsdp2_async":
        job.append("trainer.async_ckpt=true")
    if wrapper == "default":
        with pytest.raises(UserError) as info:
            train_here(run_dir, *job)
        lines = [_one_line(info)]
    else:
        done = train_ranks(run_dir, *job, return_exceptions=True)
        assert all(isinstance(e, UserError) for e in done), done
        lines = [str(e) for e in done]
    suffix = ".pt" if wrapper == "default" else ".dcp"
    checkpoint_line = f"step_00000006{suffix} (No space left on device): free space"
    if wrapper == "default":
        assert "could not write checkpoint" in lines[0] and checkpoint_line in lines[0], lines
    # On 2 ranks the disk may fill under another write first (a rank's stats line, in the
    # background save's time): that rank says so, the other may only have lost contact with
    # it; the launcher's last line names the rank that said why (worker_failed).
    assert all("\n" not in line for line in lines), lines
    assert any("No space left on device" in line for line in lines), lines
    assert all("No space left on device" in line or LOST_CONTACT in line for line in lines), lines
    named = str(worker_failed({r: 1 for r in range(len(lines))}, run_dir / "errors", run_dir))
    assert "No space left on device" in named, named
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name != f"best{suffix}")
    assert kept == [f"step_00000002{suffix}", f"step_00000004{suffix}"], kept  # no *.tmp left
    assert checkpoint.load(run_dir / "checkpoints" / f"step_00000004{suffix}")["step"] == 4


def test_a_tensorboard_dir_that_is_a_file_or_read_only_is_refused_in_one_line(
    tmp_path: Path, small_disk
) -> None:
    """Previously: `<run>/tensorboard` being a file gave SummaryWriter's NotADirectoryError
    traceback; a read-only one the advice to "free space or quota" there."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "tensorboard").write_text("my notes\n")
    job = [*SHORT, "logger=tensorboard", "trainer.max_steps=2"]
    with pytest.raises(UserError) as info:
        train_here(run_dir, *job)
    line = _one_line(info)
    assert f"{run_dir / 'tensorboard'} exists but is not a directory" in line, line
    assert (run_dir / "tensorboard").read_text() == "my notes\n"  # kept as it was
    (run_dir / "tensorboard").unlink()
    small_disk("run/tensorboard", "1m", read_only_dirs=("rank0",))
    with pytest.raises(UserError) as info:
        train_here(run_dir, *job)
    line = _one_line(info)
    assert "Read-only file system" in line and "make it writable" in line, line
    assert "free space" not in line and "quota" not in line, line


def test_read_only_output_dir_fails_in_one_line(tmp_path: Path, small_disk, capsys) -> None:
    """Previously: Hydra's "Unable to configure handler 'file'" traceback and no `error:`.
    What Hydra calls: the log file resolver of conf/hydra/ (the first write into the output
    dir), and the entry's check of hydra.run.dir on the command line."""
    disk = small_disk("ro", "1m", read_only_dirs=("run",))
    log_file = OmegaConf.create({"f": f"${{ddp_log_file:{disk / 'run'},train}}"})
    with pytest.raises(SystemExit) as info:
        log_file.f  # noqa: B018  (resolving it is what Hydra does)
    assert info.value.code == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and line.startswith("error: "), line
    assert f"cannot write to the output dir {disk / 'run'}" in line and "Read-only" in line
    assert "make it writable" in line and "free space" not in line, line  # it is not full
    with pytest.raises(SystemExit) as info:
        overrides.check_command_line([*SHORT, f"hydra.run.dir={disk / 'new'}"], [])
    assert info.value.code == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and f"hydra.run.dir={disk / 'new'} cannot be created" in line, line


def test_a_sweep_jobs_failure_record_goes_when_it_succeeds(tmp_path: Path) -> None:
    """Previously: `failure.json` of a failed sweep job stayed after the job was re-run in its
    dir and succeeded, so the next report still listed it as failed. (A real sweep writing
    failure.json for its failed jobs: tests/test_launch.py.)"""
    failed = tmp_path / "sweep" / "0_trainer.batch_size=0"
    sweeps.record_failure(failed, "trainer.batch_size=0 is not allowed")  # what the entry does
    assert "batch_size" in (failed / "failure.json").read_text()
    train_here(failed, *SHORT)
    assert not (failed / "failure.json").exists()
    assert json.loads((failed / "summary.json").read_text())["steps"] == 6


def test_non_finite_metrics_are_written_as_null() -> None:
    from hydra_ddp.loop.fit import json_safe as _json_safe

    safe = _json_safe({"val_loss": float("nan"), "val_acc": 0.5, "test_loss": float("inf")})
    assert json.loads(json.dumps(safe, allow_nan=False)) == {
        "val_loss": None,
        "val_acc": 0.5,
        "test_loss": None,
    }


def test_inf_and_nan_in_the_stats_lines_stay_apart_and_plot_run_reads_them(
    tmp_path: Path,
) -> None:
    """Previously: ctx.log's inf, -inf and NaN were all written as null in
    stats/rank<r>.jsonl, so a reader could not tell an overflow from a NaN."""
    logged = {"up": "inf", "down": "-inf", "none": "nan"}
    callbacks = [
        f"+callbacks.{k}={{_target_: helpers.user_log_callbacks.LogValue, key: {k}, value: {v}}}"
        for k, v in logged.items()
    ]
    train_here(tmp_path, *SHORT[:-2], "trainer.max_steps=2", *callbacks)
    lines = (tmp_path / "stats" / "rank0.jsonl").read_text().splitlines()
    row: dict = {}
    for line in lines:
        row.update(json.loads(line, parse_constant=_no_constant))
    assert {k: row[k] for k in logged} == logged, row  # strict JSON, and each its own
    series = plot_run.read_rank_stats(tmp_path / "stats")[0]
    assert series["up"] == [(2.0, math.inf)] and series["down"] == [(2.0, -math.inf)]
    assert math.isnan(series["none"][0][1])


def _no_constant(name: str) -> None:
    raise AssertionError(f"{name} is not JSON")
