"""hydra/launcher=ray: each job starts as a fresh interpreter would, and leaves nothing of its
config behind outside its own dir.

Slow: real sweeps of the command a user types, each on a Ray it starts itself. One CPU, so
the jobs run one after another on the same Ray worker; each job's callback
(helpers/job_probe.py) writes what its process looks like at its start, then leaves a module
global, an environment variable, a signal handler and seeds behind.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest
from conftest import FAST, REPO, TESTS, job_dirs, python_train, user_env

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="no ray extra")
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": "0"}

# A user's module that sets a torch default when imported, as some libraries do.
FLOAT64_AT_IMPORT = '''\
import torch

torch.set_default_dtype(torch.float64)


class SetsFloat64:
    """A callback that does nothing: importing its module is what counts."""
'''


def _env(tmp: Path, *paths: Path) -> dict[str, str]:
    env = user_env(tmp, **RAY_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(TESTS), *map(str, paths)])
    return env


@pytest.fixture
def beside_the_venv():
    """A folder whose path string-starts with the venv's (`<venv>-user-…`), as a user's
    `/x/vwork` beside a venv `/x/v`: what is in it is the user's code, not an installed
    library."""
    folder = Path(f"{sys.prefix}-user-{uuid.uuid4().hex[:8]}")
    try:
        folder.mkdir()
    except OSError as e:
        pytest.skip(f"cannot make a folder beside the venv {sys.prefix}: {e}")
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
@needs_ray
@pytest.mark.timeout(600)
def test_no_job_sees_what_another_imported_or_set(tmp_path: Path, beside_the_venv) -> None:
    """Job 0 names a user module (beside the venv) that sets torch's default dtype to float64
    at import; jobs 1 and 2 must start with float32 and pass, as they do alone, and none may see
    a global, variable, signal handler or seed another job left."""
    (beside_the_venv / "user_float64.py").write_text(FLOAT64_AT_IMPORT)
    probe = "helpers.job_probe.Probe"
    proc = python_train(
        tmp_path,
        "-m",
        "hydra/launcher=ray",
        "hydra.launcher.num_cpus=1",  # one job at a time, on the same Ray worker
        *FAST,
        "trainer.max_steps=20",
        f"+callbacks.probe._target_=user_float64.SetsFloat64,{probe},{probe}",
        env=_env(tmp_path, beside_the_venv),
        timeout=500,
    )
    out = proc.stdout + proc.stderr
    dirs = sorted(job_dirs(tmp_path / "multirun"), key=lambda d: d.name)
    assert len(dirs) == 3, out[-4000:]
    report = json.loads(next((tmp_path / "multirun").rglob("sweep_report.json")).read_text())
    assert [j["status"] for j in report][1:] == ["ok", "ok"], report
    probes = [json.loads((d / "probe.json").read_text()) for d in dirs[1:]]
    for p in probes:
        assert p["default_dtype"] == "torch.float32", p
        assert p["modules_from_other_jobs"] == [], p
        # Nothing one job left behind reaches the next.
        assert p["left_behind"] is None and p["env_left_behind"] is None, p
        assert "Handlers.SIG_IGN" not in p["sigusr2"], p
        assert p["torch_seed_initial"] != 1234, p
        # A fresh interpreter of its own, started by its task, in a session of its own, with
        # no signal blocked (a Ray worker blocks SIGINT) and none of Ray's worker variables.
        assert "hydra_ddp_ray_launcher._task" in p["cmdline"], p
        assert p["sid_is_own"] and p["blocked"] == [], p
        assert p["ray_worker_env"] == [] and p["breakpoint"] is None, p
        # What it was given: its threads, number, working dir first on sys.path.
        assert p["threads"] == 1 and p["omp"] == "1" and p["job"] in {"1", "2"}, p
        assert p["cwd"] == str(tmp_path) and p["sys_path0"] == str(tmp_path), p
    assert probes[0]["pid"] != probes[1]["pid"]
    assert probes[0]["random"] != probes[1]["random"]


def _task_worker(root: Path, timeout: float = 300.0) -> psutil.Process:
    """The Ray worker that runs job 0's task (titled `ray::job0`), once the job trains (its
    train.log past step 40)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = list((root / "multirun").rglob("train.log"))
        if logs and "step 40/" in logs[0].read_text():
            for p in psutil.process_iter(["cmdline"]):
                if (p.info["cmdline"] or [""])[0].startswith("ray::job0"):
                    return p
        time.sleep(0.5)
    raise AssertionError("job 0 did not train in time")


@pytest.mark.slow
@needs_ray
@pytest.mark.timeout(600)
def test_a_killed_task_leaves_no_copy_of_the_config(tmp_path: Path) -> None:
    """SIGKILL of the Ray worker that runs a job's task: the job stops with a checkpoint (what
    started it is gone), the sweep goes on and stops on SIGTERM, and no file in the temp dir
    (Ray's own included) holds the secret of the composed config."""
    secret = f"hunter2-{uuid.uuid4().hex[:8]}"
    # Short: Ray's sockets live under it, and a socket's path is at most 107 bytes.
    temp = Path(tempfile.mkdtemp(prefix="hddp", dir="/tmp"))
    cmd = [sys.executable, "-m", "hydra_ddp.train", "-m", "hydra/launcher=ray", *FAST]
    cmd += ["hydra.launcher.num_cpus=1", "trainer.max_steps=100000", "trainer.log_interval=20"]
    cmd += ["model._target_=helpers.secret_model.Guarded", f"+model.password={secret}"]
    cmd += ["+model.api_token=abc", "optim.lr=0.01,0.02"]
    env = _env(tmp_path) | {"TMPDIR": str(temp)}
    log = (tmp_path / "sweep.log").open("w")
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    family = [psutil.Process(proc.pid)]
    try:
        _task_worker(tmp_path).send_signal(signal.SIGKILL)
        first = tmp_path / "multirun"
        deadline = time.monotonic() + 90
        while not list(first.rglob("0_*/failure.json")):
            assert proc.poll() is None, (tmp_path / "sweep.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "job 0 did not stop after its task was killed"
            time.sleep(0.5)
        family += family[0].children(recursive=True)
        proc.send_signal(signal.SIGTERM)  # job 1 runs meanwhile: the sweep stops it
        rc = proc.wait(timeout=120)
        out = (tmp_path / "sweep.log").read_text()
        assert rc == 128 + signal.SIGTERM, out[-4000:]
        job0 = next(first.rglob("0_*/failure.json")).parent
        failure = json.loads((job0 / "failure.json").read_text())
        assert "stopped on SIGTERM at step" in failure["error"], failure
        assert list((job0 / "checkpoints").glob("step_*.pt")), job0
        holding = [
            str(p)
            for p in temp.rglob("*")
            if p.is_file() and not p.is_symlink() and secret.encode() in _read(p)
        ]
        assert not holding, f"the secret is left in {holding}"
    finally:
        for p in family:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # a socket, a file Ray removed meanwhile
        return b""
