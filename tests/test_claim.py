"""One job per run dir (hydra_ddp/rundir/claim.py), in process: a live holder on this host refuses a
second job in one line naming it; a dead holder, an earlier attempt of the same launcher job,
or a holder on another host whose heartbeat stopped is taken over with a warning; a finished
job gives its claim back."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hydra_ddp.rundir import claim
from hydra_ddp.rundir.paths import SWEPT_KEYS_FILE


@pytest.fixture(autouse=True)
def _no_job_id(monkeypatch):
    for key in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "SUBMITIT_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    yield
    claim.release_all()


def _write(run_dir: Path, **holder) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / claim.NAME
    path.write_text(json.dumps({"host": socket.gethostname(), "since": time.time(), **holder}))
    return path


def test_a_live_holder_refuses_a_second_job_naming_it(tmp_path: Path, capsys) -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write(tmp_path, pid=other.pid, job="SLURM_JOB_ID=41")
        with pytest.raises(SystemExit) as e:
            claim.claim(tmp_path)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {tmp_path} is in use by another job (pid {other.pid} on")
        assert "SLURM_JOB_ID=41" in err and len(err.strip().splitlines()) == 1
    finally:
        other.kill()
        other.wait()


def test_dead_holders_and_earlier_attempts_are_taken_over(tmp_path: Path, monkeypatch) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write(tmp_path / "a", pid=dead.pid)
    claim.claim(tmp_path / "a")
    assert json.loads((tmp_path / "a" / claim.NAME).read_text())["pid"] == os.getpid()

    # A requeued SLURM job: same job id, its first attempt's process "alive" elsewhere.
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    _write(tmp_path / "b", pid=1, host="another-node", job="SLURM_JOB_ID=77")
    claim.claim(tmp_path / "b")

    # Another host, another job, its heartbeat stopped long ago: a lost node.
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    old = _write(tmp_path / "c", pid=1, host="lost-node", job="SLURM_JOB_ID=5")
    os.utime(old, (time.time() - claim.STALE_S - 1,) * 2)
    claim.claim(tmp_path / "c")
    # ...but with a fresh heartbeat it is alive.
    _write(tmp_path / "d", pid=1, host="busy-node", job="SLURM_JOB_ID=6")
    with pytest.raises(SystemExit):
        claim.claim(tmp_path / "d")

    # A killed job's process that its parent has not reaped yet (a zombie: an orphan waits for
    # PID 1, which reaps late or, in a container with no init, never) is gone too: another
    # job's rank 1 waits for its own rank 0 instead of refusing, and rank 0 takes over.
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the child never exited"
        time.sleep(0.01)
    _write(tmp_path / "e", pid=zombie.pid, job="SLURM_JOB_ID=9")
    claim.wait_for_own_job(tmp_path / "e", timeout_s=0.5)  # no SystemExit
    claim.claim(tmp_path / "e")
    assert json.loads((tmp_path / "e" / claim.NAME).read_text())["pid"] == os.getpid()
    zombie.wait()

    claim.release_all()
    assert not any((tmp_path / d / claim.NAME).exists() for d in "abce")
    assert (tmp_path / "d" / claim.NAME).exists()  # not ours: left alone


def _lone_rank_with_bad_master(env, cfg, run):
    from helpers.inproc import train

    return train(cfg, env, run)


@pytest.mark.slow
def test_an_unresolvable_master_addr_fails_at_once_naming_the_host(tmp_path: Path) -> None:
    from conftest import FAST
    from helpers import ranks
    from helpers.inproc import job

    from hydra_ddp.errors import UserError

    cfg, run = job(tmp_path, *FAST, "dist.timeout_s=300")
    t0 = time.monotonic()
    done = ranks.run(
        _lone_rank_with_bad_master, cfg, run, world_size=1, group=False,
        env={"MASTER_ADDR": "no-such-host.invalid"}, return_exceptions=True, timeout=60,
    )  # fmt: skip
    assert time.monotonic() - t0 < 30
    assert isinstance(done[0], UserError), done[0]
    assert "MASTER_ADDR=no-such-host.invalid does not resolve" in str(done[0])


@pytest.mark.slow  # two real jobs in one dir
def test_a_second_job_in_a_live_jobs_dir_is_refused_and_a_killed_ones_is_taken_over(
    tmp_path: Path,
) -> None:
    from conftest import user_env

    env = user_env(tmp_path)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "hydra_ddp.train", "logger=none", "trainer.progress=false",
           f"hydra.run.dir={run_dir}", "dist.nproc_per_node=2"]  # fmt: skip
    first = subprocess.Popen([*cmd, "trainer.max_steps=100000", "trainer.ckpt_interval=20"],
                             cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not list((run_dir / "checkpoints").glob("step_*.pt")):
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        before = sorted(p.name for p in run_dir.iterdir())
        second = subprocess.run([*cmd, "trainer.max_steps=10"], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        assert second.returncode == 2, second.stderr[-2000:]
        errors = [ln for ln in second.stderr.splitlines() if "error:" in ln]
        assert len(errors) == 1 and f"pid {first.pid} on" in errors[0], second.stderr[-2000:]
        assert sorted(p.name for p in run_dir.iterdir()) == before  # nothing written
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the whole job, as a lost node would
        first.wait()
    third = subprocess.run([*cmd, "trainer.max_steps=40"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=180)  # fmt: skip
    assert third.returncode == 0, third.stderr[-3000:]
    assert "taking over" in third.stderr and "resumed from" in (
        (run_dir / "train_rank0.log").read_text()
    )


@pytest.mark.slow  # a real self-launched job whose parent is SIGKILLed, then two restarts
def test_workers_of_a_killed_launcher_stop_and_keep_the_dir_until_they_have(
    tmp_path: Path,
) -> None:
    """Previously: SIGKILL of the self-launch parent left its workers training; a restart
    within a second took the claim over (its pid was dead) and both jobs wrote
    step_00000003.pt and step 3's stats. Now the workers get SIGTERM (parent-death signal),
    save and stop, and until then their lock on the claim refuses the restart."""
    import psutil
    from conftest import REPO, user_env

    env = user_env(tmp_path)
    env["PYTHONPATH"] += os.pathsep + str(REPO / "tests")
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "hydra_ddp.train", "logger=none", "trainer.progress=false",
           f"hydra.run.dir={run_dir}", "dist.nproc_per_node=2", "trainer.max_steps=30",
           "trainer.log_interval=1", "model._target_=helpers.slow_model.SlowMLP",
           "+model.sleep_s=8"]  # fmt: skip
    first = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    stats = run_dir / "stats" / "rank0.jsonl"
    deadline = time.monotonic() + 180
    while not (stats.exists() and stats.read_text().count("\n") >= 1):
        assert first.poll() is None and time.monotonic() < deadline, "no step logged"
        time.sleep(0.1)
    workers = [p for p in psutil.Process(first.pid).children()  # spawned ranks, not trackers
               if "spawn_main" in " ".join(p.cmdline())]  # fmt: skip
    assert len(workers) == 2
    first.kill()  # the launcher only: its workers are orphans now
    first.wait()
    try:
        second = subprocess.run([*cmd, "trainer.max_steps=5"], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        assert second.returncode == 2, second.stderr[-2000:]
        errors = [ln for ln in second.stderr.splitlines() if "error:" in ln]
        assert len(errors) == 1 and "still runs" in errors[0], second.stderr[-2000:]
        _, alive = psutil.wait_procs(workers, timeout=60)
        assert not alive, "the orphaned workers kept training"
    finally:
        for p in workers:
            if p.is_running():
                p.kill()
    log0 = (run_dir / "train_rank0.log").read_text()
    assert "stopped on SIGTERM at step" in log0, log0[-2000:]
    stopped = sorted((run_dir / "checkpoints").glob("step_*.pt"))
    assert stopped, "the orphans saved nothing"
    third = subprocess.run([*cmd, "model.sleep_s=0"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=180)  # fmt: skip
    assert third.returncode == 0, third.stderr[-3000:]
    # One writer per step: no step's stats row written twice into rank 0's file.
    steps = [json.loads(ln)["step"] for ln in stats.read_text().splitlines()]
    assert len(steps) == len(set(steps)), steps


@pytest.mark.slow  # two submitit_local sweeps of 2 tasks each
def test_a_second_submitit_sweep_into_the_same_dir_is_refused_and_writes_nothing(
    tmp_path: Path,
) -> None:
    """Previously: the loser's rank 0 refused, its rank 1 waited 300 s and then wrote a port
    error into the *winner's* train_rank1.log; the winner's .claim stayed after it finished
    (its `job` field null: submitit's local job id was not read, nor the claim given back).
    Then: each of the loser's tasks refused, but only after submitit had started them (~40 s),
    inside submitit's UncompletedJobError traceback. Now the loser's launching process refuses
    in one line before it submits anything: the sweep dir is claimed for the whole sweep."""
    from conftest import REPO, user_env

    env = user_env(tmp_path)
    env["PYTHONPATH"] += os.pathsep + str(REPO / "tests")
    sweep, gate = tmp_path / "sweep", tmp_path / "go"
    cmd = [sys.executable, "-m", "hydra_ddp.train", "-m", "hydra/launcher=submitit_local",
           "hydra.launcher.tasks_per_node=2", "hydra.launcher.timeout_min=5", "logger=none",
           "trainer.progress=false", f"hydra.sweep.dir={sweep}", "trainer.max_steps=3"]  # fmt: skip
    winner = subprocess.Popen(
        [*cmd, "+callbacks.gate._target_=helpers.gate_callbacks.WaitForFile",
         f"+callbacks.gate.path={gate}"],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    job = sweep / "0"
    try:
        deadline = time.monotonic() + 240
        while not (job / "stats" / "rank1.jsonl").exists():  # both ranks are training
            assert winner.poll() is None and time.monotonic() < deadline, "winner not running"
            time.sleep(0.2)
        claim_text = (job / claim.NAME).read_text()
        assert "SUBMITIT_LOCAL_JOB_ID=" in claim_text, claim_text
        assert str(winner.pid) in (sweep / claim.NAME).read_text()  # the sweep's own claim
        # The sweep's own files, the winner's submitit jobs, its rank 1's log (waiting at step 1).
        names = ("multirun.yaml", SWEPT_KEYS_FILE, "sweep_jobs.jsonl")
        kept = [sweep / n for n in names] + [job / "train_rank1.log"]
        before = {p: p.read_bytes() for p in kept}
        submitted = sorted((sweep / ".submitit").iterdir())
        started = time.monotonic()
        loser = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                               timeout=300)  # fmt: skip
        took = time.monotonic() - started
        assert loser.returncode == 2, loser.stderr[-3000:]
        said = [ln for ln in (loser.stdout + loser.stderr).splitlines() if ln.strip()]
        assert len(said) == 1, said  # no traceback, no submitit start-up
        assert said[0].startswith(f"error: {sweep} is in use by another job (pid {winner.pid}")
        assert "choose another hydra.sweep.dir" in said[0], said
        # The launching process's start-up (torch, Hydra) only: the ~40 s of submitit's is gone.
        assert took < 30, took
        assert {p: p.read_bytes() for p in kept} == before  # nothing written into them
        assert sorted((sweep / ".submitit").iterdir()) == submitted  # nothing submitted
        for f in [*sweep.rglob("*.log"), *sweep.rglob("*.err"), *sweep.rglob("*.out")]:
            assert "in use by another job" not in f.read_text(), f
    finally:
        gate.touch()
    assert winner.wait(timeout=240) == 0
    assert (job / "summary.json").exists()
    assert not (job / claim.NAME).exists(), "the winner's claim outlived it"
    assert not (sweep / claim.NAME).exists(), "the winner's sweep claim outlived it"
