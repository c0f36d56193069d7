"""`python -m hydra_ddp.distributed.torchrun`: torchrun whose stop on a signal exits 128 + the
signal.

Plain torchrun, on SIGTERM to its agent (a scheduler's stop) or Ctrl-C, forwards the signal,
waits for its workers' checkpoint, then exits 1 with its own SignalException traceback (see
docs/when_things_go_wrong.md). The wrapper runs the same torchrun and exits as its workers do.
Below it, every stop signal (USR1, USR2 too) under both launchers (the wrapper and the
self-launch), sent to the launcher, the whole process group or the workers alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import FAST, start_logged

from hydra_ddp import checkpoint

SLOW_STEPS = [
    *FAST,
    "model._target_=helpers.slow_model.SlowMLP",
    "+model.sleep_s=1",
    "trainer.max_steps=60",
    "trainer.log_interval=1",
    "trainer.ckpt_interval=0",  # only the stop's checkpoint
]


def _steps_logged(job: Path) -> int:
    path = job / "stats" / "rank0.jsonl"
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()[:-1]  # the last may be half-written
    return max((json.loads(ln).get("step", 0) for ln in lines), default=0)


@pytest.mark.slow  # real torchrun jobs, two of them
@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["SIGTERM to the agent", "Ctrl-C"])
def test_a_stopped_torchrun_exits_like_its_workers_with_a_checkpoint(
    tmp_path: Path, how: str
) -> None:
    job = tmp_path / "job"
    cmd = [sys.executable, "-m", "hydra_ddp.distributed.torchrun", "--standalone",
           "--nproc_per_node=2", "-m", "hydra_ddp.train", *SLOW_STEPS,
           f"hydra.run.dir={job}"]  # fmt: skip
    proc, out = start_logged(cmd, tmp_path)
    try:
        deadline = time.monotonic() + 240
        while _steps_logged(job) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.1)
        signum = signal.SIGTERM if how.startswith("SIGTERM") else signal.SIGINT
        if signum == signal.SIGTERM:
            proc.send_signal(signum)  # the agent only, as a scheduler's stop
        else:
            os.killpg(proc.pid, signum)  # the terminal: every process of the job
        rc = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(True)]
            for p in procs:
                p.kill()
    text = out.read_text()
    assert rc == 128 + signum, text[-3000:]
    assert "Traceback" not in text and "SignalException" not in text, text[-4000:]
    assert "death signal" not in text and "closing signal" not in text, text[-3000:]
    newest = checkpoint.latest(job)
    assert newest is not None, text[-3000:]
    step = checkpoint.load(newest)["step"]
    name = signal.Signals(signum).name
    assert f"stopped on {name} at step {step} of 60 with a checkpoint" in text, text[-3000:]


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        p.kill()


@pytest.mark.slow  # five real 2-rank launches of 1 s steps, 20-40 s each
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "launcher, signum, to, loader_workers",
    [
        ("self-launch", signal.SIGUSR1, "launcher", 0),  # a scheduler's signal to the main process
        ("self-launch", signal.SIGUSR2, "group", 0),  # to every process of the job
        ("self-launch", signal.SIGTERM, "group", 2),  # DataLoader workers too (a SLURM time limit)
        ("torchrun", signal.SIGUSR2, "launcher", 0),  # to torchrun's agent
        ("torchrun", signal.SIGTERM, "workers", 0),  # to the workers alone (`pkill -f train`)
    ],
)
def test_every_stop_signal_ends_any_launch_with_its_checkpoint_and_status(
    tmp_path: Path, launcher: str, signum: int, to: str, loader_workers: int
) -> None:
    """Previously: the self-launch's agent and torchrun's handled only TERM, INT, HUP and QUIT,
    so SIGUSR1/SIGUSR2 (submitit's, many SLURM sites') killed the launching process at once
    (exit 138/140, no line) while its workers saved 8 s later: a scheduler that reaps a task's
    processes when its main one exits lost the checkpoint. Workers signalled alone made
    torchrun print its `ChildFailedError` report (`failed (exitcode: 143)`) and exit 1. A USR2
    to the self-launch's process group killed multiprocessing's resource tracker, whose
    successor printed 9 `KeyError` tracebacks; with DataLoader workers, a SIGTERM to the group
    killed them and their rank failed before the checkpoint. Now each ends as SIGTERM to the
    agent does: the launcher waits for the workers' checkpoint, exits 128 + the signal, with the
    stop line and no traceback or agent notes."""
    job = tmp_path / "job"
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "hydra_ddp.distributed.torchrun", "--standalone",
               "--nproc_per_node=2", "-m", "hydra_ddp.train"]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "hydra_ddp.train", "dist.nproc_per_node=2"]
    loader = f"trainer.num_workers={loader_workers}"
    proc, out = start_logged([*cmd, *SLOW_STEPS, loader, f"hydra.run.dir={job}"], tmp_path)
    try:
        deadline = time.monotonic() + 240
        while _steps_logged(job) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.1)
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if "resource_tracker" not in " ".join(p.cmdline())]  # fmt: skip
        if to == "launcher":
            proc.send_signal(signum)
        elif to == "group":
            os.killpg(proc.pid, signum)
        else:
            for p in workers:
                if "hydra_ddp.train" in " ".join(p.cmdline()):
                    p.send_signal(signum)
        rc = proc.wait(timeout=120)
        # The launcher was the last to go: no worker outlives it.
        assert not [p for p in workers if p.is_running() and p.status() != "zombie"], workers
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    text = out.read_text()
    assert rc == 128 + signum, text[-3000:]
    for noise in ("Traceback", "KeyError", "exitcode", "ChildFailedError", "death signal",
                  "closing signal", "resource_tracker"):  # fmt: skip
        assert noise not in text, (noise, text[-4000:])
    newest = checkpoint.latest(job)
    assert newest is not None, text[-3000:]
    step = checkpoint.load(newest)["step"]
    name = signal.Signals(signum).name
    assert f"stopped on {name} at step {step} of 60 with a checkpoint" in text, text[-3000:]
    if launcher == "self-launch":  # its own line after the workers', with the checkpoint
        assert f"resume from its newest checkpoint ({newest.name})" in text, text[-3000:]
