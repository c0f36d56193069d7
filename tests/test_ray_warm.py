"""hydra/launcher=ray's warm job starts: each job forked from a process that imported torch,
Hydra and the template once, with nothing of one job reaching the next; that process ends by
itself (idle, its keeper gone, the code changed).

Slow: a real sweep of the command a user types, on a Ray it starts with one CPU, so its three
jobs run one after another and are forked from the node's one warm server. Each
job's callback (helpers/warm_probe.py) writes what its process looks like at its start, then
leaves a module global, an environment variable, a signal handler and seeds behind.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FAST, REPO, TESTS, job_dirs, python_train, user_env

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="no ray extra")
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": "0"}


def _sweep(tmp: Path, *overrides: str):
    env = user_env(tmp, **RAY_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(TESTS)])
    return python_train(
        tmp,
        "-m",
        "hydra/launcher=ray",
        "hydra.launcher.num_cpus=1",
        *FAST,
        "trainer.max_steps=20",
        "+callbacks.probe._target_=helpers.warm_probe.Probe",
        "optim.lr=0.001,0.002,0.003",
        *overrides,
        env=env,
        timeout=400,
    )


def _probes(tmp: Path) -> list[dict]:
    dirs = [d for d in job_dirs(tmp / "multirun") if (d / "probe.json").is_file()]
    assert len(dirs) == 3, dirs
    return [json.loads((d / "probe.json").read_text()) | {"dir": d.name} for d in dirs]


@pytest.mark.slow
@needs_ray
@pytest.mark.timeout(600)
def test_warm_jobs_share_a_parent_and_nothing_else(tmp_path: Path) -> None:
    proc = _sweep(tmp_path)
    assert proc.returncode == 0, proc.stderr[-6000:]
    probes = _probes(tmp_path)
    # Forked from one warm server (the imports paid once), each its own process and session.
    assert len({p["ppid"] for p in probes}) == 1, probes
    assert "hydra_ddp_ray_launcher._warm" in probes[0]["parent_cmdline"], probes[0]
    assert len({p["pid"] for p in probes}) == 3
    assert all(p["sid_is_own"] for p in probes)
    # Nothing one job left behind reaches the next.
    for p in probes:
        assert p["left_behind"] is None and p["env_left_behind"] is None, p
        assert "Handlers.SIG_IGN" not in p["sigusr2"], p
    # Fresh seeds as a fresh interpreter has: Python's differ between jobs, torch's default
    # is torch's own, never the 1234 a previous job set.
    assert len({p["random"] for p in probes}) == 3, probes
    assert all(p["torch_seed_initial"] != 1234 for p in probes)
    # What the fresh process had: the job's threads, number, working dir first on sys.path.
    for p in probes:
        assert p["threads"] == 1 and p["omp"] == "1", p
        assert p["job"] in {"0", "1", "2"}
        assert p["cwd"] == str(tmp_path) and p["sys_path0"] == str(tmp_path), p


@pytest.mark.slow
@needs_ray
@pytest.mark.timeout(600)
def test_warm_start_false_starts_a_fresh_interpreter_per_job(tmp_path: Path) -> None:
    proc = _sweep(tmp_path, "hydra.launcher.warm_start=false")
    assert proc.returncode == 0, proc.stderr[-6000:]
    probes = _probes(tmp_path)
    # Each job's process is a new interpreter started by its task (the Ray worker).
    for p in probes:
        assert "hydra_ddp_ray_launcher._job" in p["cmdline"], p
        assert "_warm" not in p["parent_cmdline"] and p["left_behind"] is None, p
    assert len({p["pid"] for p in probes}) == 3


def _server(path: Path, idle_s: float, tmp: Path) -> subprocess.Popen:
    """The warm server as its keeper starts it (stdin: the line whose end means the keeper
    died), once it listens."""
    cmd = [sys.executable, "-m", "hydra_plugins.hydra_ddp_ray_launcher._warm", str(path)]
    proc = subprocess.Popen(
        [*cmd, str(idle_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=user_env(tmp)
    )
    deadline = time.monotonic() + 120
    while not path.exists():
        assert proc.poll() is None, f"the warm server exited with {proc.returncode}"
        assert time.monotonic() < deadline, "the warm server did not listen within 120 s"
        time.sleep(0.1)
    return proc


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_warm_server_ends_idle_with_its_keeper_or_when_the_code_changed(tmp_path: Path) -> None:
    """The server a Ray sweep leaves behind (it outlives the sweep) ends by itself: after
    warm_idle_s without a job, when its keeper (the Ray actor) is gone, and, told so by the
    next job, when the template's code changed since it imported it."""
    from hydra_plugins.hydra_ddp_ray_launcher import _warm

    # Idle: a task that connects and hangs up is no job; then nothing for 2 s, and it ends.
    path = tmp_path / "idle.sock"
    proc = _server(path, 2.0, tmp_path)
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(path))
    assert proc.wait(timeout=60) == 0
    assert not path.exists()

    # Its keeper gone (stdin closed): it ends at once, idle time or not.
    path = tmp_path / "keeper.sock"
    proc = _server(path, 600.0, tmp_path)
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0
    assert not path.exists()

    # The template changed: the next job hears `stale`, the keeper is told to start a new
    # server, and this one (no job running) ends with the status that says so.
    path = tmp_path / "stale.sock"
    proc = _server(path, 600.0, tmp_path)
    source = REPO / "src" / "hydra_ddp" / "api.py"
    stat = source.stat()
    try:
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        request = {"spec": "x", "result": str(tmp_path / "r"), "env": {}, "cwd": str(tmp_path)}
        child = _warm.start(str(path), request, wait_s=5.0)
        assert child is None  # no server came back (no keeper here): the task starts cold
        assert proc.stdout.readline().strip() == b"stale"
        assert proc.wait(timeout=30) == 3
        assert not path.exists()
    finally:
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        if proc.poll() is None:
            proc.kill()
