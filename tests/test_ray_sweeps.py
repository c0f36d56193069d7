"""hydra/launcher=ray: the jobs of a sweep side by side, scheduled by Ray.

In process (default suite): the preset composes, each job's resources follow its config, a
job bigger than every node is refused before any starts, and the sweep's process takes every
stop signal (real signals, sent to the test's own process).

Slow (real sweeps of the command a user types, on 2 cores): one Ray head started here with
`ray start --head` (the cluster path, `hydra.launcher.address=...`) is shared by the sweeps that
finish; the stop tests (Ctrl-C, SIGUSR1) let their sweeps start and stop a Ray of their own,
and check that nothing of either is left. tests/test_ray_isolation.py checks that each job starts
as a fresh interpreter would.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import FAST, REPO, TESTS, job_dirs, python_train, summary, user_env

from hydra_ddp import checkpoint
from hydra_ddp.errors import UserError

# The slow tests run Ray (the ray extra: pip install -e '.[ray]'); the in-process one does not.
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="no ray extra")

# Ray's token auth writes ~/.ray/auth_token by default; the tests leave $HOME alone.
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": "0"}
SHORT = [*FAST, "trainer.max_steps=30", "trainer.log_interval=10"]
# Jobs long enough (a few seconds) that two started side by side overlap whatever the jitter of
# their starts (each job's process imports torch and the template).
PAIRED = [*FAST, "trainer.max_steps=800", "trainer.log_interval=100"]


# --------------------------------------------------------------------------------------------
# In process: composition and the resource arithmetic
# --------------------------------------------------------------------------------------------


def _compose(*overrides: str):
    from hydra import compose, initialize_config_dir

    from hydra_ddp.launch.command import find_own_plugins

    find_own_plugins()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(
            "train", overrides=["hydra/launcher=ray", *overrides], return_hydra_config=True
        )


def test_ray_preset_composes_and_sizes_each_job() -> None:
    from hydra_plugins.hydra_ddp_ray_launcher._sweep import RayJob, fit_to_nodes, job_resources

    cfg = _compose()
    assert cfg.hydra.launcher._target_.endswith("hydra_ddp_ray_launcher.ray_launcher.RayLauncher")
    assert cfg.hydra.launcher.address is None and cfg.hydra.launcher.stop_grace_s > 0
    # Default: one CPU per rank, one thread per rank, GPUs decided by the cluster (-1).
    assert job_resources(cfg) == (1, 1.0, -1.0, 1)
    assert job_resources(_compose("dist.nproc_per_node=2")) == (2, 2.0, -1.0, 1)
    # Eight CPUs for two ranks: four OpenMP threads each; one CPU for two ranks: still one.
    big = _compose("dist.nproc_per_node=2", "hydra.launcher.cpus_per_job=8")
    assert job_resources(big) == (2, 8.0, -1.0, 4)
    assert job_resources(_compose("dist.nproc_per_node=2", "hydra.launcher.cpus_per_job=1"))[3] == 1
    assert job_resources(_compose("dist.device=cpu", "dist.nproc_per_node=4"))[2] == 0.0
    assert job_resources(_compose("hydra.launcher.gpus_per_job=1"))[2] == 1.0

    def jobs(*configs):
        return [RayJob(n, [], c, *job_resources(c)) for n, c in enumerate(configs)]

    # A CPU machine: null GPUs become 0 and two-rank jobs fit a 2-CPU node.
    two = jobs(cfg, _compose("dist.nproc_per_node=2"))
    fit_to_nodes(two, [{"CPU": 2.0}], "here")
    assert [j.gpus for j in two] == [0.0, 0.0]
    # A GPU node: each job asks for one GPU per rank.
    two = jobs(cfg, _compose("dist.nproc_per_node=2"))
    fit_to_nodes(two, [{"CPU": 16.0, "GPU": 8.0}], "here")
    assert [j.gpus for j in two] == [1.0, 2.0]
    # Bigger than every node: one line naming the job, the key and what to do.
    for job_config, nodes, words in [
        (_compose("dist.nproc_per_node=4"), [{"CPU": 16.0, "GPU": 2.0}, {"CPU": 8}], "4 GPU(s)"),
        (_compose("hydra.launcher.cpus_per_job=3"), [{"CPU": 2.0}], "3 CPU(s)"),
    ]:
        with pytest.raises(UserError) as e:
            fit_to_nodes(jobs(cfg, job_config), nodes, "the Ray cluster at x:6379")
        message = str(e.value)
        assert "\n" not in message and words in message and "job #1" in message, message
        assert "hydra.launcher." in message and "dist.nproc_per_node" in message, message


def test_an_old_warm_start_override_still_runs_with_one_warning() -> None:
    from hydra_plugins.hydra_ddp_ray_launcher._sweep import ignored_keys

    launcher = _compose("hydra.launcher.warm_start=false").hydra.launcher
    assert ignored_keys(_compose().hydra.launcher) == []
    assert ignored_keys(launcher) == [
        "hydra.launcher.warm_start is ignored (every job starts as a fresh interpreter): drop it"
    ]
    both = _compose("hydra.launcher.warm_start=true", "hydra.launcher.warm_idle_s=60")
    assert [line.split()[0] for line in ignored_keys(both.hydra.launcher)] == [
        "hydra.launcher.warm_start",
        "hydra.launcher.warm_idle_s",
    ]


STOPS = [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2]


def test_the_sweeps_process_takes_every_stop_signal() -> None:
    """Real signals to this process: during a launch each becomes a stop request (the jobs save
    a checkpoint); outside one (Ray starting, between two batches) it ends the sweep with
    128 + the signal, SIGINT as Ctrl-C does everywhere."""
    from hydra_plugins.hydra_ddp_ray_launcher._sweep import StopRequests

    before = {sig: signal.getsignal(sig) for sig in STOPS}
    try:
        stop = StopRequests()
        for sig in STOPS:
            with stop.launching():
                signal.raise_signal(sig)
                assert stop.signum == sig
            stop.signum = None
        for sig in STOPS[1:]:
            with pytest.raises(SystemExit) as e:
                signal.raise_signal(sig)
            assert e.value.code == 128 + sig
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        # One that came as the last launch ended stops the next batch before it starts.
        stop.signum = signal.SIGUSR2
        with pytest.raises(SystemExit) as e, stop.launching():
            pass
        assert e.value.code == 128 + signal.SIGUSR2
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


# --------------------------------------------------------------------------------------------
# Slow: real sweeps
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory):
    """A one-machine Ray cluster with 2 CPUs (`ray start --head`), shared by the sweeps that
    join it; stopped, with every process of it, at the end."""
    tmp = tmp_path_factory.mktemp("ray_head")
    port = _free_port()
    env = user_env(tmp, **RAY_ENV)
    cmd = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--head",
        "--block",
        f"--port={port}",
        "--num-cpus=2",
        "--num-gpus=0",
        "--include-dashboard=false",
        "--disable-usage-stats",
    ]
    log = (tmp / "head.log").open("w")
    proc = subprocess.Popen(
        cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in (tmp / "head.log").read_text():
            assert proc.poll() is None, (tmp / "head.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the Ray head did not start in 120 s"
            time.sleep(0.5)
        yield address, proc
    finally:
        family = _tree(proc.pid)
        os.killpg(proc.pid, signal.SIGTERM)
        _, alive = psutil.wait_procs(family, timeout=30)
        for p in alive:
            p.kill()
        log.close()


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _sweep(tmp: Path, address: str, *overrides: str, timeout: float = 400):
    return python_train(
        tmp,
        "-m",
        "hydra/launcher=ray",
        f"hydra.launcher.address={address}",
        *overrides,
        env=user_env(tmp, **RAY_ENV),
        timeout=timeout,
    )


def _sweep_dir(tmp: Path) -> Path:
    dirs = [p.parent for p in (tmp / "multirun").rglob("sweep_report.json")]
    assert len(dirs) == 1, dirs
    return dirs[0]


def _journal(sweep: Path) -> dict[int, dict[str, float]]:
    """Job number -> its start and end times, from the sweep's journal."""
    times: dict[int, dict[str, float]] = {}
    for line in (sweep / "sweep_jobs.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "num" not in record:  # the sweep's own start
            continue
        times.setdefault(record["num"], {})[record["event"]] = record["time"]
    return times


def _overlap(a: dict[str, float], b: dict[str, float]) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


@pytest.mark.slow
@needs_ray
@pytest.mark.timeout(600)
def test_four_one_cpu_jobs_run_two_at_a_time_on_two_cores(tmp_path: Path, head) -> None:
    """Two at a time, each with one thread; the sweep's own process, which runs no job, never
    imports torch."""
    address, _ = head
    # A callback of the sweep's process, importable from its working dir.
    shutil.copy(TESTS / "helpers" / "driver_probe.py", tmp_path / "driver_probe.py")
    driver = "+hydra.callbacks.driver._target_=driver_probe.DriverModules"
    proc = _sweep(tmp_path, address, *PAIRED, driver, "optim.lr=0.01,0.02,0.03,0.04")
    assert proc.returncode == 0, proc.stderr[-6000:]
    sweep = _sweep_dir(tmp_path)
    dirs = job_dirs(sweep)
    assert len(dirs) == 4, dirs
    for job in dirs:
        s = summary(job)
        assert s["steps"] == 800 and s["world_size"] == 1, s
        assert (job / "stats" / "rank0.jsonl").is_file() and (job / ".hydra").is_dir()
        assert (job / "stats" / "summary.json").is_file()
    report = json.loads((sweep / "sweep_report.json").read_text())
    assert [j["status"] for j in report] == ["ok"] * 4, report
    assert all(j["objective"] is not None for j in report)
    # Two at a time: each job overlaps exactly one other (its pair); never three at once.
    times = _journal(sweep)
    assert sorted(times) == [0, 1, 2, 3]
    pairs = {(a, b) for a in times for b in times if a < b and _overlap(times[a], times[b])}
    assert len(pairs) >= 2, times
    for a, b, c in [(0, 1, 2), (0, 1, 3), (0, 2, 3), (1, 2, 3)]:
        assert not {(a, b), (a, c), (b, c)} <= pairs, f"three jobs at once: {times}"
    # Each rank ran with its CPU share of OpenMP threads (one CPU: one thread).
    out = proc.stdout + proc.stderr
    assert "1 CPU(s) (1 thread(s) per rank)" in out, out[-3000:]
    driver_modules = json.loads((sweep / "driver_modules.json").read_text())
    assert driver_modules == {"torch": []}, driver_modules


@pytest.mark.slow
@needs_ray
@pytest.mark.timeout(600)
def test_two_two_rank_jobs_at_once_each_its_own_process_group(tmp_path: Path, head) -> None:
    address, _ = head
    overrides = [
        *FAST,
        "trainer.max_steps=200",
        "trainer.log_interval=50",
        "dist.nproc_per_node=2",
        "hydra.launcher.cpus_per_job=1",  # both jobs on the 2 cores at once
        "optim.lr=0.01,0.02",
    ]
    proc = _sweep(tmp_path, address, *overrides)
    assert proc.returncode == 0, proc.stderr[-6000:]
    sweep = _sweep_dir(tmp_path)
    times = _journal(sweep)
    assert _overlap(times[0], times[1]), f"the two jobs did not run at once: {times}"
    # Each job's ranks met at their own rendezvous, which no rank of the other job joined.
    ports = {}
    for job in job_dirs(sweep):
        logs = [(job / f"train_rank{rank}.log").read_text() for rank in (0, 1)]
        found = {re.search(r"rendezvous=\S+:(\d+)", text).group(1) for text in logs}
        assert len(found) == 1, f"{job.name}: its ranks at two rendezvous: {found}"
        ports[job.name] = found.pop()
    assert len(set(ports.values())) == 2, f"both jobs at one rendezvous port: {ports}"
    for job in job_dirs(_sweep_dir(tmp_path)):
        s = summary(job)
        assert s["world_size"] == 2 and s["steps"] == 200, s
        # Each rank joined its own job's 2-rank group, never a 4-rank one.
        for rank in (0, 1):
            log = (job / f"train_rank{rank}.log").read_text()
            assert f"rank={rank}/2" in log, log[-2000:]


@pytest.mark.slow
@needs_ray
@pytest.mark.timeout(600)
def test_a_failing_job_does_not_stop_the_others(tmp_path: Path, head) -> None:
    address, _ = head
    # AdamW refuses a negative learning rate: job 2 fails as it builds its optimizer.
    proc = _sweep(tmp_path, address, *SHORT, "optim.lr=0.01,0.02,-1,0.04")
    assert proc.returncode == 1, proc.stderr[-6000:]
    sweep = _sweep_dir(tmp_path)
    report = json.loads((sweep / "sweep_report.json").read_text())
    assert [j["status"] for j in report] == ["ok", "ok", "FAILED", "ok"], report
    assert "Invalid learning rate" in report[2]["detail"], report[2]
    for j in report[:2] + report[3:]:
        assert summary(Path(j["dir"]))["steps"] == 30
    out = proc.stdout + proc.stderr
    assert "Invalid learning rate" in out, out[-3000:]


@pytest.mark.slow
@needs_ray
@pytest.mark.timeout(300)
def test_a_job_bigger_than_every_node_fails_alone_in_one_line(tmp_path: Path, head) -> None:
    """Ray would queue it forever: it is not handed to Ray, fails with one line naming the key
    and what to do, and the other jobs run (each job is checked as it is composed, so the
    first runs while the later ones are)."""
    address, _ = head
    proc = _sweep(tmp_path, address, *SHORT, "dist.device=cpu", "dist.nproc_per_node=1,4")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1 and "job #1 of the sweep asks for 4 CPU(s)" in errors[0], out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    report = json.loads((_sweep_dir(tmp_path) / "sweep_report.json").read_text())
    assert [j["status"] for j in report] == ["ok", "FAILED"], report
    assert "asks for 4 CPU(s)" in report[1]["detail"] and "hydra.launcher." in report[1]["detail"]
    assert summary(Path(report[0]["dir"]))["steps"] == 30


@pytest.mark.slow
@needs_ray
@pytest.mark.timeout(600)
def test_optuna_keeps_n_jobs_trials_in_flight(tmp_path: Path, head) -> None:
    pytest.importorskip("optuna", reason='needs Optuna, the sweep extra: pip install -e ".[sweep]"')
    address, _ = head
    proc = _sweep(
        tmp_path,
        address,
        "hparams_search=digits_optuna",
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.n_jobs=2",
        *PAIRED,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    sweep = _sweep_dir(tmp_path)
    times = _journal(sweep)
    # Two trials at a time: 0 with 1, then 2 with 3 (Optuna asks for the next two after both).
    assert _overlap(times[0], times[1]) and _overlap(times[2], times[3]), times
    assert max(times[0]["end"], times[1]["end"]) <= min(times[2]["start"], times[3]["start"])
    # What each job returned is what Optuna optimised: its best is the report's best.
    report = json.loads((sweep / "sweep_report.json").read_text())
    assert [j["status"] for j in report] == ["ok"] * 4, report
    best = next(j for j in report if j["best"])
    results = (sweep / "optimization_results.yaml").read_text()
    assert f"best_value: {best['objective']}" in results, (results, best)


@pytest.mark.slow
@needs_ray
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "sig, to_group", [(signal.SIGINT, True), (signal.SIGUSR1, False)], ids=["ctrl_c", "sigusr1"]
)
def test_a_stop_signal_stops_every_job_with_a_checkpoint_and_leaves_no_process(
    tmp_path: Path, sig: int, to_group: bool
) -> None:
    """Ctrl-C (SIGINT to the terminal's process group) or a scheduler's SIGUSR1 to the sweep's
    process: the running jobs save a checkpoint, the queued ones never start, the report is
    written, the sweep's claim given back, and the sweep exits 128 + the signal. The sweep
    starts its own Ray here (no address, `warm_start` of an older command line ignored), and
    must stop it too."""
    cmd = [sys.executable, "-m", "hydra_ddp.train", "-m", "hydra/launcher=ray"]
    cmd += ["hydra.launcher.num_cpus=2", "hydra.launcher.warm_start=false", *FAST]
    cmd += ["trainer.max_steps=100000", "trainer.log_interval=20", "optim.lr=0.01,0.02,0.03,0.04"]
    log = (tmp_path / "sweep.log").open("w")
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=user_env(tmp_path, **RAY_ENV),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    family: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + 200
    try:
        while True:  # until two jobs train
            family.update({p.pid: p for p in _tree(proc.pid)})
            logs = list((tmp_path / "multirun").rglob("train.log"))
            if sum("step 40/" in p.read_text() for p in logs) >= 2:
                break
            assert proc.poll() is None, (tmp_path / "sweep.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "two jobs did not train within 200 s"
            time.sleep(0.5)
        family.update({p.pid: p for p in _tree(proc.pid)})
        if to_group:
            os.killpg(proc.pid, sig)  # what the terminal does on Ctrl-C
        else:
            os.kill(proc.pid, sig)
        stopped_at = time.monotonic()
        rc = proc.wait(timeout=30)
        _, alive = psutil.wait_procs(
            list(family.values()), timeout=max(0.0, 30 - (time.monotonic() - stopped_at))
        )
        left = [p for p in alive if p.is_running()]
        left += [
            p for p in psutil.process_iter() if _cwd(p) == str(tmp_path) and p.pid != os.getpid()
        ]
        assert not left, f"left behind 30 s after Ctrl-C: {[_describe(p) for p in left]}"
    finally:
        for p in [*_tree(proc.pid), *family.values()]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        log.close()
    out = (tmp_path / "sweep.log").read_text()
    assert rc == 128 + sig, out[-4000:]
    assert f"stopping the sweep on {signal.Signals(sig).name}: " in out, out[-4000:]
    assert f"sweep stopped on {signal.Signals(sig).name}: re-run" in out, out[-4000:]
    assert "hydra.launcher.warm_start is ignored" in out, out[-4000:]
    sweep = _sweep_dir(tmp_path)
    assert not (sweep / ".claim").exists(), "the sweep's claim is left"
    report = json.loads((sweep / "sweep_report.json").read_text())
    assert len(report) == 4 and all(j["status"] == "PREEMPTED" for j in report), report
    started = [j for j in report if j["dir"] and Path(j["dir"]).is_dir()]
    assert len(started) >= 2, report
    for j in started:
        job = Path(j["dir"])
        newest = checkpoint.latest(job)
        assert newest is not None, f"no checkpoint in {job}"
        step = checkpoint.load(newest)["step"]
        assert f"stopped on SIGTERM at step {step} of 100000 with a checkpoint" in j["detail"], j
    for j in report:
        if j not in started:
            assert j["detail"].startswith("not started"), j
    assert "Traceback" not in out, out[-4000:]


def _cwd(p: psutil.Process) -> str | None:
    try:
        return p.cwd()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def _describe(p: psutil.Process) -> str:
    try:
        return f"{p.pid} {' '.join(p.cmdline())[:120]}"
    except psutil.Error:
        return str(p.pid)


@pytest.mark.slow
@needs_ray
@pytest.mark.timeout(600)
def test_a_pruned_optuna_sweep_keeps_n_jobs_trials_in_flight(tmp_path: Path, head) -> None:
    """hydra/sweeper=optuna_pruned on Ray: two trials at a time, each reporting from its own
    process to the sweep's SQLite study and stopped by the pruner (a threshold no accuracy
    reaches: every trial, at its evaluation of step 200). Each trial lasts about a second: the
    second of a pair starts once it is composed (~0.1 s), so a shorter one could be over."""
    optuna = pytest.importorskip(
        "optuna", reason='needs Optuna, the sweep extra: pip install -e ".[sweep]"'
    )
    address, _ = head
    proc = _sweep(
        tmp_path,
        address,
        "hparams_search=digits_optuna_pruned",
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.n_jobs=2",
        "~hydra/sweeper/pruner",
        "+hydra.sweeper.pruner={_target_:optuna.pruners.ThresholdPruner,lower:1.1,n_warmup_steps:150}",
        *FAST,
        "trainer.max_steps=300",
        "trainer.log_interval=100",
        "trainer.eval_interval=100",
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    sweep = _sweep_dir(tmp_path)
    times = _journal(sweep)
    assert _overlap(times[0], times[1]) and _overlap(times[2], times[3]), times
    study = optuna.load_study(
        study_name="digits_mlp_pruned", storage=f"sqlite:///{sweep}/optuna.db"
    )
    assert [t.state.name for t in study.trials] == ["PRUNED"] * 4
    assert all(sorted(t.intermediate_values) == [100, 200] for t in study.trials)
    report = json.loads((sweep / "sweep_report.json").read_text())
    assert [(j["status"], j["steps"]) for j in report] == [("PRUNED", 200)] * 4, report
    for j in report:
        assert (Path(j["dir"]) / "checkpoints" / "step_00000200.pt").is_file()
