"""One job per run dir (hydra_ddp/rundir/claim.py): an OS lock that the kernel drops when its
holder dies. In process, against real holder processes: a live holder refuses a second job in
one line naming it; a killed one (reaped or still a zombie) is taken over at once; a joined
worker keeps the dir after its launcher is killed, a forked child (a DataLoader worker) does
not; of many claimers started at once exactly one wins; a finished job gives its claim back.
Below, real jobs: two identical commands and two sweeps started at once on one dir."""

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

from hydra_ddp.rundir import claim
from hydra_ddp.rundir.paths import SWEPT_KEYS_FILE

# A process that claims the dir argv[1] as a job's rank 0 does, says so, and holds it; with
# argv[2] == "worker" a worker that joins the claim first (a self-launched rank, here a fresh
# interpreter as spawn makes), with "fork" a forked child (a DataLoader worker).
_HOLDER = """
import os, subprocess, sys, time
from hydra_ddp.rundir import claim
claim.claim(sys.argv[1])
if sys.argv[2] == "worker":
    subprocess.Popen([sys.executable, "-c", "import sys, time; from hydra_ddp.rundir import "
                      "claim; claim.join(sys.argv[1]); print('joined', flush=True); "
                      "time.sleep(120)", sys.argv[1]])
    sys.stdin.readline()  # the test says when the worker has joined
elif sys.argv[2] == "fork" and os.fork() == 0:
    time.sleep(120)
    os._exit(0)
print("held", os.getpid(), flush=True)
time.sleep(120)
"""


@pytest.fixture(autouse=True)
def _no_job_id(monkeypatch):
    for key in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "SUBMITIT_JOB_ID", "SUBMITIT_LOCAL_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    yield
    claim.release_all()
    claim.release_sweep()


def _hold(run_dir: Path, how: str = "alone", **env: str) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(run_dir), how], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, env={**os.environ, **env}, start_new_session=True,
    )  # fmt: skip
    if how == "worker":
        assert proc.stdout.readline() == "joined\n"
        proc.stdin.write("go\n")
        proc.stdin.flush()
    assert proc.stdout.readline().startswith("held"), "the holder did not claim"
    return proc


def _refused(run_dir: Path, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        claim.claim(run_dir)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_a_live_holder_refuses_and_a_killed_one_is_taken_over_at_once(
    tmp_path: Path, capsys
) -> None:
    holder = _hold(tmp_path, SLURM_JOB_ID="41")
    try:
        err = _refused(tmp_path, capsys)
        assert err.startswith(f"error: {tmp_path} is in use by another job (pid {holder.pid} on")
        assert "(SLURM_JOB_ID=41), since " in err and "choose another hydra.run.dir" in err
        holder.kill()  # not reaped: a zombie, whose files the kernel has closed
        deadline = time.monotonic() + 30
        while psutil.Process(holder.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the holder never exited"
            time.sleep(0.01)
        claim.claim(tmp_path)
        assert f"taking over {tmp_path / claim.NAME} from a job that is gone (pid {holder.pid}" in (
            capsys.readouterr().err
        )
        assert json.loads((tmp_path / claim.NAME).read_text())["pid"] == os.getpid()
    finally:
        holder.kill()
        holder.wait()
    claim.release_all()
    assert not (tmp_path / claim.NAME).exists()  # given back: the next job finds no record
    claim.claim(tmp_path)
    assert "taking over" not in capsys.readouterr().err


@pytest.mark.slow
def test_a_joined_worker_keeps_the_dir_after_its_launcher_dies_a_forked_child_does_not(
    tmp_path: Path, capsys
) -> None:
    launcher = _hold(tmp_path / "a", "worker")
    worker = next(p for p in psutil.Process(launcher.pid).children())
    try:
        launcher.kill()
        launcher.wait()
        err = _refused(tmp_path / "a", capsys)
        assert f"(pid {launcher.pid} on" in err and "a process of that job still runs" in err
    finally:
        worker.kill()
        worker.wait()
    claim.claim(tmp_path / "a")  # the worker's death let go of it

    parent = _hold(tmp_path / "b", "fork")
    child = next(p for p in psutil.Process(parent.pid).children())
    try:
        parent.kill()
        parent.wait()
        assert child.is_running()
        claim.claim(tmp_path / "b")  # the child still runs but holds nothing
    finally:
        child.kill()


_RACER = """
import sys, time
from hydra_ddp.rundir import claim
while not __import__("os").path.exists(sys.argv[2]):
    time.sleep(0.001)
claim.claim(sys.argv[1])
time.sleep(3)
claim.release_all()
"""


def test_of_claimers_started_at_once_exactly_one_wins(tmp_path: Path) -> None:
    run_dir, go = tmp_path / "run", tmp_path / "go"
    run_dir.mkdir()
    cmd = [sys.executable, "-c", _RACER, str(run_dir), str(go)]
    racers = [subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True) for _ in range(6)]
    time.sleep(1.0)  # every racer imported the module and waits for the start
    go.touch()
    codes = [r.wait(timeout=60) for r in racers]
    assert sorted(codes) == [0] + [2] * 5, codes
    said = [r.stderr.read() for r in racers]
    assert all(s.count("error: ") == 1 for s, c in zip(said, codes) if c == 2), said
    assert not (run_dir / claim.NAME).exists()  # the winner gave it back (its normal exit)


def test_ranks_wait_for_their_own_rank_0_and_refuse_another_live_job(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    other = _hold(tmp_path / "a", SLURM_JOB_ID="5")
    try:
        monkeypatch.setenv("SLURM_JOB_ID", "6")
        with pytest.raises(SystemExit) as e:
            claim.wait_for_own_job(tmp_path / "a", timeout_s=30)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {tmp_path / 'a'} is in use by another job (pid {other.pid}")
        assert "this job's rank 0 stops too" in err and len(err.strip().splitlines()) == 1
    finally:
        other.kill()
        other.wait()
    # The dead job's record stays until a rank 0 takes it over: rank 1 waits for its own.
    t0 = time.monotonic()
    claim.wait_for_own_job(tmp_path / "a", timeout_s=0.5)
    assert time.monotonic() - t0 >= 0.5
    claim.claim(tmp_path / "a")  # this job's rank 0 (here the same process)
    t0 = time.monotonic()
    claim.wait_for_own_job(tmp_path / "a", timeout_s=30)
    assert time.monotonic() - t0 < 5


def test_a_sweep_claim_outlives_its_jobs_claims(tmp_path: Path) -> None:
    """The basic launcher runs a sweep's jobs in the process that holds the sweep dir."""
    claim.claim_sweep(tmp_path)
    (tmp_path / "0").mkdir()
    claim.claim(tmp_path / "0")
    claim.claim(tmp_path)  # a job whose dir is the sweep dir: already this process's
    claim.release_all()  # the job's end
    assert not (tmp_path / "0" / claim.NAME).exists()
    assert (tmp_path / claim.NAME).exists()
    claim.release_sweep()
    assert not (tmp_path / claim.NAME).exists()


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


def _at_once(cmds: list[list[str]], cwd: Path, env: dict) -> list[subprocess.CompletedProcess]:
    """Start the commands together (milliseconds apart; each then spends seconds importing and
    composing, so they reach their claims at about the same moment) and wait for them all."""
    procs = [
        subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )  # fmt: skip
        for cmd in cmds
    ]
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


@pytest.mark.slow  # two real jobs at once; the claim race itself: test_of_claimers_started_...
def test_two_identical_commands_on_one_run_dir_at_once(tmp_path: Path) -> None:
    """Two `python -m hydra_ddp.train ... hydra.run.dir=D` started together: one refused in one
    line (exit 2) before it writes anything, the other finishes a whole, uncorrupted run."""
    from conftest import FAST, user_env

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "hydra_ddp.train", *FAST, "trainer.max_steps=12",
           "trainer.log_interval=1", "trainer.ckpt_interval=4",
           f"hydra.run.dir={run_dir}"]  # fmt: skip
    done = _at_once([cmd, cmd], tmp_path, user_env(tmp_path))
    codes = sorted(d.returncode for d in done)
    assert codes == [0, 2], [d.stderr[-3000:] for d in done]
    winner, loser = sorted(done, key=lambda d: d.returncode)
    said = [ln for ln in (loser.stdout + loser.stderr).splitlines() if ln.strip()]
    assert len(said) == 1 and said[0].startswith(f"error: {run_dir} is in use by another job"), said
    assert "taking over" not in winner.stderr
    # One run's files: one config record, one log, every step once, whole checkpoints.
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith(".hydra")) == [".hydra"]
    assert (run_dir / "train.log").read_text().count("resumed from") == 0
    steps = [json.loads(ln)["step"] for ln in (run_dir / "stats" / "rank0.jsonl").open()]
    assert steps == list(range(1, 13)), steps
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 12
    import torch

    for ckpt in sorted((run_dir / "checkpoints").glob("step_*.pt")):
        assert torch.load(ckpt, weights_only=False)["step"] == int(ckpt.stem[5:]), ckpt
    assert not (run_dir / claim.NAME).exists()


@pytest.mark.slow  # two real sweeps at once
def test_two_sweeps_into_one_sweep_dir_at_once(tmp_path: Path) -> None:
    """Two identical 2-job sweeps (`optim.lr=0.001,0.003`, W&B offline) into one sweep dir,
    started together: one refused in one line (exit 2) before it writes or starts anything,
    the other runs both jobs into one sweep report; every job's W&B run is in the sweep's group
    with the swept key as its config, so W&B groups the runs per configuration."""
    from conftest import FAST, user_env
    from helpers import wandb_records

    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "hydra_ddp.train", "-m", *FAST, "logger=wandb",
           "trainer.max_steps=4", "trainer.log_interval=2", "optim.lr=0.001,0.003",
           f"hydra.sweep.dir={sweep}"]  # fmt: skip
    done = _at_once([cmd, cmd], tmp_path, user_env(tmp_path, WANDB_MODE="offline"))
    assert sorted(d.returncode for d in done) == [0, 2], [d.stderr[-3000:] for d in done]
    winner, loser = sorted(done, key=lambda d: d.returncode)
    said = [ln for ln in (loser.stdout + loser.stderr).splitlines() if ln.strip()]
    assert len(said) == 1 and said[0].startswith(f"error: {sweep} is in use by another job"), said
    assert "choose another hydra.sweep.dir" in said[0]
    jobs = json.loads((sweep / "sweep_report.json").read_text())
    assert [(j["job"], j["status"]) for j in jobs] == [
        ("0_optim.lr=0.001", "ok"),
        ("1_optim.lr=0.003", "ok"),
    ]  # fmt: skip
    lines = (sweep / "sweep_jobs.jsonl").read_text().splitlines()
    events = [json.loads(ln)["event"] for ln in lines]
    assert events == ["sweep_start", "start", "end", "start", "end"]
    assert not any(p.name == claim.NAME for p in sweep.rglob("*"))
    infos = []
    for job, lr in (("0_optim.lr=0.001", 1e-3), ("1_optim.lr=0.003", 3e-3)):
        (record,) = (sweep / job).glob("wandb/offline-run-*/run-*.wandb")
        info = wandb_records.run_info(record)
        assert info["config"]["swept"] == {"optim.lr": lr}, info["config"].get("swept")
        assert job.split("_", 1)[1] in info["name"] and wandb_records.exit_code(record) == 0
        infos.append(info)
    assert infos[0]["group"] == infos[1]["group"] == f"sweep-{tmp_path.name}-sweep"
    assert infos[0]["id"] != infos[1]["id"]
