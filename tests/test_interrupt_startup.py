"""Ctrl-C while a job's workers start: one line, exit 130, no traceback from the workers.

Previously the terminal's SIGINT (sent to every process of the job) hit each worker while it
imported torch or built its model, before the loop's handlers: every worker printed its
KeyboardInterrupt traceback, and the launcher could advise resuming from a checkpoint that did
not exist. Real launches, interrupted at two points of start-up: the workers' own start (the
interpreter importing torch) and the model's constructor (helpers/slow_start_model.py sleeps
there, as a large model's build does).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import FAST, start_logged, user_env

SLOW_START = [
    *FAST,
    "model._target_=helpers.slow_start_model.SlowStartMLP",
    "+model.start_s=120",  # far longer than the test waits: a stop must cut it short
]


def _wait(proc: subprocess.Popen, out: Path, ready, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill(proc)
            pytest.fail(f"never {what}:\n{out.read_text()[-3000:]}")
        time.sleep(0.01)


def _kill(proc: subprocess.Popen) -> None:
    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        p.kill()
    psutil.wait_procs(procs, timeout=10)


def _ctrl_c(proc: subprocess.Popen, out: Path, within_s: float = 90) -> tuple[int, str, float]:
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does: every process of the job
    try:
        rc = proc.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        _kill(proc)
        pytest.fail(f"still running {within_s} s after Ctrl-C:\n{out.read_text()[-3000:]}")
    return rc, out.read_text(), time.monotonic() - sent


# A launcher's first spawn starts multiprocessing's resource tracker, which unblocks SIGINT in
# the launcher on its way (CPython's bpo-33613 fix): the workers then started with SIGINT open.
# In a fresh interpreter, as the launcher is: in pytest's the tracker may run already.
_MASK_OF_A_SPAWNED_WORKER = """
import multiprocessing, signal, sys

def report(pipe):  # before the worker imports anything of ours, as its start-up does
    pipe.send(sorted(map(int, signal.pthread_sigmask(signal.SIG_BLOCK, []))))

if __name__ == "__main__":
    from hydra_ddp.launch import interrupt

    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()  # not a Queue: its lock would start the tracker before the block
    with interrupt.held_for_workers():
        for _ in range(2):  # the second start too: the tracker runs by then
            worker = ctx.Process(target=report, args=(theirs,))
            worker.start()
            print(ours.recv())
            worker.join()
        held = sorted(map(int, signal.pthread_sigmask(signal.SIG_BLOCK, [])))
    print(held, sorted(map(int, signal.pthread_sigmask(signal.SIG_BLOCK, []))))
"""


@pytest.mark.timeout(120)
def test_workers_spawned_by_the_self_launch_start_with_sigint_blocked(tmp_path: Path) -> None:
    (tmp_path / "spawn_mask.py").write_text(_MASK_OF_A_SPAWNED_WORKER)
    done = subprocess.run([sys.executable, "spawn_mask.py"], cwd=tmp_path, env=user_env(tmp_path),
                          capture_output=True, text=True, timeout=100)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    sigint = int(signal.SIGINT)
    first, second, after = done.stdout.splitlines()
    assert first == second == f"[{sigint}]", done.stdout  # each worker starts with it held
    assert after == f"[{sigint}] []", done.stdout  # held in the launcher, then let go


def _spawned_workers(proc: subprocess.Popen) -> list[psutil.Process]:
    """The self-launch's workers: the agent's multiprocessing spawn children (not its tracker)."""
    try:
        children = psutil.Process(proc.pid).children()
    except psutil.NoSuchProcess:
        return []
    found = []
    for child in children:
        try:
            if "--multiprocessing-fork" in child.cmdline():
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def _importing_torch(workers: list[psutil.Process]) -> bool:
    """Two workers, each with torch's library mapped: each is importing torch (or past it)."""
    try:
        maps = [[m.path for m in w.memory_maps()] for w in workers]
    except psutil.Error:
        return False
    return len(maps) == 2 and all(any("libtorch" in path for path in m) for m in maps)


def _workers_started(tmp_path: Path) -> bool:
    """Both self-launched workers are past their imports: their log files exist."""
    return len(list((tmp_path / "job").glob("train_rank*.log"))) == 2


@pytest.mark.slow  # real self-launched jobs, two of them
@pytest.mark.timeout(600)
@pytest.mark.parametrize("when", ["importing", "building the model"])
def test_ctrl_c_while_self_launched_workers_start_is_one_line(tmp_path: Path, when: str) -> None:
    job = tmp_path / "job"
    cmd = [sys.executable, "-m", "hydra_ddp.train", *SLOW_START, "dist.nproc_per_node=2",
           f"hydra.run.dir={job}"]  # fmt: skip
    proc, out = start_logged(cmd, tmp_path)
    _wait(proc, out, lambda: "starting 2 workers" in out.read_text(), "started the workers")
    if when == "importing":
        # As soon as both workers import torch: past multiprocessing's start-up, whose data
        # the agent is still writing into a worker's pipe for a few milliseconds after its
        # interpreter exists (a Ctrl-C then leaves that worker's EOFError traceback: torch's
        # spawn, before any code of ours runs there).
        _wait(proc, out, lambda: _importing_torch(_spawned_workers(proc)), "imported torch")
        assert not _workers_started(tmp_path), "the workers started too fast to test this"
    else:
        _wait(proc, out, lambda: _workers_started(tmp_path), "started both workers")
        time.sleep(1)  # in the model's constructor (it sleeps 120 s)
    rc, text, took = _ctrl_c(proc, out)
    assert rc == 128 + signal.SIGINT, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-4000:]
    assert "Exception ignored" not in text, text[-4000:]
    stops = [line for line in text.splitlines() if "SIGINT" in line]
    assert len(stops) == 1, text[-3000:]  # nor the agent's "Received 2 death signal" notes
    assert stops[0].endswith(
        "stopped on SIGINT, before any checkpoint was written: nothing to resume, re-running "
        "the same command starts again from step 0"
    ), stops
    assert not (job / "checkpoints").exists() or not any((job / "checkpoints").iterdir())
    assert took < 60, took  # the model's 120 s build was cut short


@pytest.mark.slow  # real torchrun jobs, three of them
@pytest.mark.timeout(600)
@pytest.mark.parametrize("when", ["writing the run dir", "importing", "building the model"])
def test_ctrl_c_while_torchrun_workers_start_is_one_line(tmp_path: Path, when: str) -> None:
    """The workers say it once (rank 0), whether Hydra still sets up the run dir (its log, then
    .hydra/), they import the job's modules (train.py imports them where the job runs) or
    build the model; torchrun's agent still prints its own SignalException traceback and exits
    1 (torch's; see docs/when_things_go_wrong.md)."""
    job = tmp_path / "job"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "hydra_ddp.train", *SLOW_START, f"hydra.run.dir={job}"]  # fmt: skip
    proc, out = start_logged(cmd, tmp_path)
    if when == "writing the run dir":  # Hydra opens rank 0's log before it writes .hydra/
        _wait(proc, out, lambda: (job / "train_rank0.log").is_file(), "opened its log")
    else:
        _wait(proc, out, lambda: (job / ".hydra" / "config.yaml").is_file(), "composed it")
    building = [tmp_path / f"building_rank{rank}" for rank in (0, 1)]
    if when != "building the model":
        assert not any(p.exists() for p in building), "the ranks imported too fast to test this"
    else:
        _wait(proc, out, lambda: all(p.exists() for p in building), "started building")
        time.sleep(1)  # in the model's constructor (it sleeps 120 s)
    rc, text, took = _ctrl_c(proc, out)
    assert rc == 1, text[-3000:]  # torchrun's
    ours = text.split("Traceback (most recent call last):")
    assert len(ours) == 2 and "SignalException" in ours[1], text[-4000:]  # torchrun's only
    assert "KeyboardInterrupt" not in text and "Exception ignored" not in text, text[-4000:]
    stops = [line for line in ours[0].splitlines() if "stopped on SIGINT" in line]
    assert len(stops) == 1, text[-3000:]
    assert "stopped on SIGINT, before any checkpoint was written: nothing to resume" in stops[0]
    assert took < 60, took
