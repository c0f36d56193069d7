"""A stop signal to a sweep's process under the basic launcher, whose jobs run in that process:
SIGUSR1 and SIGUSR2 (submitit's and many SLURM sites' preemption signals) stop it as SIGTERM
does; a submitit sweep's process, which only waits for its jobs, stops with its report. The Ray
launcher's sweep: tests/test_ray_sweeps.py (its stop tests, and the in-process
check of every stop signal).

Slow: a real sweep of the command a user types, signalled as its first job trains.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import FAST, start_logged

from hydra_ddp import checkpoint


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2], ids=lambda s: signal.Signals(s).name
)
def test_a_basic_sweep_stops_alike_on_every_stop_signal(tmp_path: Path, sig: int) -> None:
    """The running job saves a checkpoint and stops, the next never starts, the report lists
    the stopped job with the line that resumes it, the sweep's claim is given back, and the
    sweep exits 128 + the signal."""
    cmd = [sys.executable, "-m", "hydra_ddp.train", "-m", *FAST, "trainer.max_steps=100000"]
    proc, console = start_logged([*cmd, "trainer.log_interval=20", "optim.lr=0.01,0.02"], tmp_path)
    try:
        deadline = time.monotonic() + 200
        while not any("step 40/" in p.read_text() for p in tmp_path.rglob("train.log")):
            assert proc.poll() is None, console.read_text()[-4000:]
            assert time.monotonic() < deadline, "the first job did not train within 200 s"
            time.sleep(0.2)
        proc.send_signal(sig)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = console.read_text()
    name = signal.Signals(sig).name
    assert rc == 128 + sig, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    reports = list(tmp_path.rglob("sweep_report.json"))
    assert len(reports) == 1, f"no sweep report: {out[-3000:]}"
    sweep = reports[0].parent
    report = json.loads((sweep / "sweep_report.json").read_text())
    assert [j["status"] for j in report] == ["PREEMPTED"], report
    job = Path(report[0]["dir"])
    step = checkpoint.load(checkpoint.latest(job))["step"]
    assert f"stopped on {name} at step {step} of 100000 with a checkpoint" in report[0]["detail"]
    # Under -m Hydra ignores hydra.run.dir: the sweep, run again in its dir, resumes the job.
    assert f"re-run the sweep with hydra.sweep.dir={sweep} (each job" in report[0]["detail"]
    assert not list(sweep.glob("1_*")), "the second job started"
    assert not (sweep / ".claim").exists(), "the sweep's claim is left"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_submitit_sweeps_process_stops_on_sigusr1_with_its_report(tmp_path: Path) -> None:
    """A submitit sweep's process only waits for its jobs: SIGUSR1 to it ends it with one line,
    the report and exit 138, its claim given back; the job it submitted is the scheduler's and
    runs on until it is stopped itself."""
    cmd = [
        sys.executable, "-m", "hydra_ddp.train", "-m", "hydra/launcher=local",
        "hydra.launcher.tasks_per_node=1", "dist.device=cpu", *FAST, "trainer.max_steps=100000",
        "trainer.log_interval=20", "optim.lr=0.01",
    ]  # fmt: skip
    proc, console = start_logged(cmd, tmp_path)
    try:
        deadline = time.monotonic() + 200
        while not list(tmp_path.glob("multirun/*/*/0*/stats/rank0.jsonl")):
            assert proc.poll() is None, console.read_text()[-4000:]
            assert time.monotonic() < deadline, "the job did not train within 200 s"
            time.sleep(0.3)
        proc.send_signal(signal.SIGUSR1)
        rc = proc.wait(timeout=60)
        job_still_runs = _kill_submitit_jobs(tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
        _kill_submitit_jobs(tmp_path)
    out = console.read_text()
    assert rc == 128 + signal.SIGUSR1, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert "sweep stopped on SIGUSR1: its submitted jobs run on under submitit" in out, out
    [report] = list(tmp_path.rglob("sweep_report.json"))
    assert len(json.loads(report.read_text())) == 1, report.read_text()
    assert not (report.parent / ".claim").exists(), "the sweep's claim is left"
    assert job_still_runs, "the submitted job did not run on"


def _kill_submitit_jobs(tmp_path: Path) -> bool:
    """Kill the local submitit jobs of this test's sweep; True if there was one."""
    import psutil

    found = False
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if str(tmp_path) in " ".join(p.info["cmdline"] or []):
                found = True
                p.kill()
    return found
