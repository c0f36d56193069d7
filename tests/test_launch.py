"""Launch anywhere: every way of starting train.py runs one 2-rank DDP job end to end.

    a. torchrun --nproc_per_node=2 -m hydra_ddp.train ...           (tests/test_train.py's default
                                                                      job)
    b. python -m hydra_ddp.train dist.nproc_per_node=2 ...          (the job starts its workers;
                                                                      tests/test_components_outside_the_package.py)
    c. python -m hydra_ddp.train -m dist.nproc_per_node=2 a=1,2 ...  (a sweep of DDP jobs, here)
    d. two torchrun agents ("nodes") meeting through c10d rendezvous on localhost (slow)
    e. hydra/launcher=submitit_local with 2 tasks (the SLURM code path without SLURM; slow)

Each finds one output dir per job with one .hydra/ and summary.json (world_size 2). The fast
in-process tests at the bottom pin down the Hydra resolvers that make this work.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
from conftest import (
    FAST,
    REPO,
    job_dirs,
    ok,
    only_job_dir,
    python_train,
    run,
    summary,
    torchrun,
    user_env,
)
from helpers import (
    ranks,
    wandb_records,  # noqa: E402  (a test helper next to conftest.py)
)

TINY = [*FAST, "trainer.max_steps=20"]


def assert_one_ddp_job(job: Path, world_size: int = 2) -> dict:
    """One job's dir: one .hydra/ dump, summary.json from a `world_size`-rank job, and one log
    file per rank."""
    s = summary(job)
    assert s["world_size"] == world_size, s
    assert s["steps"] == 20, s
    assert len(s["rows_held_per_rank"]) == world_size, s
    assert (job / ".hydra" / "config.yaml").is_file()
    for rank in range(world_size):
        assert (job / f"train_rank{rank}.log").is_file(), sorted(p.name for p in job.iterdir())
    return s


def hydra_dumps(root: Path) -> list[Path]:
    return sorted(root.rglob(".hydra"))


def sweep_dir(root: Path) -> Path:
    dirs = [p.parent for p in (root / "multirun").rglob("multirun.yaml")]
    assert len(dirs) == 1, dirs
    return dirs[0]


# --------------------------------------------------------------------------------------------
# a, b: one node
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_launch_single_node_script_builds_the_torchrun_command(tmp_path: Path) -> None:
    script = REPO / "scripts" / "launch_single_node.sh"
    env = user_env(tmp_path, DRY_RUN="1", PYTHON=sys.executable)
    out = ok(
        run(
            ["bash", str(script), "-n", "2", "model=cnn", "optim.lr=1e-3"],
            tmp_path,
            env=env,
            timeout=60,
        )
    ).stdout
    assert (
        "-m hydra_ddp.distributed.torchrun --standalone --nproc_per_node=2 -m hydra_ddp.train "
        "model=cnn optim.lr=1e-3" in out
    ), out
    # No -n: one rank per visible GPU, and 1 (with a note) where there is none.
    env_cpu = {**env, "CUDA_VISIBLE_DEVICES": ""}
    proc = ok(run(["bash", str(script), "trainer.epochs=1"], tmp_path, env=env_cpu, timeout=60))
    assert "--nproc_per_node=1 -m hydra_ddp.train trainer.epochs=1" in proc.stdout
    assert "no GPU visible" in proc.stderr
    bad = run(["bash", str(script), "-n", "two"], tmp_path, env=env, timeout=60)
    assert bad.returncode == 2 and "positive integer" in bad.stderr


def test_slurm_example_builds_one_torchrun_per_node(tmp_path: Path) -> None:
    """The sbatch script under fake `srun`/`scontrol`: the command each node would run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-node-07\\ngpu-node-08\\n'\n")
    (bin_dir / "srun").write_text('#!/bin/sh\necho "srun $*"\n')
    # The cluster's name service: the allocation's nodes resolve, nothing else does.
    (bin_dir / "getent").write_text(
        '#!/bin/sh\ncase "$2" in gpu-node-0*) echo "10.0.0.7 $2";; *) exit 2;; esac\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = user_env(
        tmp_path,
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="gpu-node-[07-08]",
        SLURM_JOB_NUM_NODES="2",
        SLURM_GPUS_ON_NODE="4",
        SLURM_CPUS_PER_TASK="32",
        SLURM_SUBMIT_DIR=str(tmp_path),
    )
    script = str(REPO / "scripts" / "slurm_example.sbatch")
    out = ok(run(["bash", script, "model=cnn"], tmp_path, env=env, timeout=60)).stdout
    for part in (
        "srun --kill-on-bad-exit=1 --cpus-per-task=32",
        "-m hydra_ddp.distributed.torchrun --nnodes=2",  # torchrun that exits 143 on a preemption
        "--nnodes=2",
        "--nproc_per_node=4",
        "--rdzv-backend=c10d",
        # The rendezvous port comes from the job id: two jobs on one head node never share it.
        "--rdzv-endpoint=gpu-node-07:24242",
        "--rdzv-id=4242",
        "--max-restarts=0",
        # One run dir per job id, so a requeue (same id) resumes there.
        "-m hydra_ddp.train hydra.run.dir=outputs/slurm/4242 model=cnn",
    ):
        assert part in out, (part, out)
    # A head node that does not resolve: one line at once, not minutes of rendezvous retries.
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho no-such-node\n")
    bad = run(["bash", script], tmp_path, env=env, timeout=60)
    assert bad.returncode == 2 and "srun" not in bad.stdout
    assert "error: the rendezvous host no-such-node" in bad.stderr, bad.stderr
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-node-07\\ngpu-node-08\\n'\n")
    # A user's own run dir wins.
    out = ok(run(["bash", script, "hydra.run.dir=mine"], tmp_path, env=env, timeout=60)).stdout
    assert "-m hydra_ddp.train hydra.run.dir=mine\n" in out or out.rstrip().endswith(
        "-m hydra_ddp.train hydra.run.dir=mine"
    ), out


# --------------------------------------------------------------------------------------------
# c: sweeps
# --------------------------------------------------------------------------------------------


# 40 hex chars, the shape of a real key; made at run time, so that no file holds it (a job
# records the checkout's uncommitted changes, this file among them).
FAKE_KEY = hashlib.sha1(b"hydra-ddp tests: not a W&B key").hexdigest()
PLOT = REPO / "scripts" / "plot_run.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """A 3-job sweep of 2-rank jobs with W&B (offline, a key in the environment) in one
    process, judged by validation accuracy:
    #0 optim.lr=1e30 fails inside the workers (non-finite loss at step 2),
    #1 optim.lr=0.001 trains (after a failed job in the same process),
    #2 optim.lr=-1 fails validation in the launching process, before any worker starts."""
    tmp = tmp_path_factory.mktemp("sweep")
    proc = python_train(
        tmp,
        "-m",
        "dist.nproc_per_node=2",
        "logger=wandb",
        "trainer.progress=false",
        "trainer.max_steps=20",
        "trainer.log_interval=1",
        "trainer.monitor=val/acc",
        "trainer.monitor_mode=max",
        "optim.lr=1e30,0.001,-1",
        env=user_env(tmp, WANDB_MODE="offline", WANDB_API_KEY=FAKE_KEY),
        timeout=240,
    )
    return tmp, proc


def _report(root: Path) -> dict[str, dict]:
    report = json.loads((sweep_dir(root) / "sweep_report.json").read_text())
    return {j["job"].split("_", 1)[0]: j for j in report}


@pytest.mark.slow  # one real 2-rank sweep (28 s) for six tests; the default suite keeps to 5 min
def test_sweep_failing_jobs_do_not_stop_it(sweep) -> None:
    root, proc = sweep
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = _report(root)
    assert [jobs[n]["status"] for n in ("0", "1", "2")] == ["FAILED", "ok", "FAILED"], jobs
    assert "non-finite" in jobs["0"]["detail"]
    assert "optim.lr" in jobs["2"]["detail"]
    # One dir per job, each with one .hydra/; the good one also holds summary.json.
    dirs = job_dirs(sweep_dir(root))
    assert len(dirs) == 3 and len(hydra_dumps(root)) == 3, dirs
    good = Path(jobs["1"]["dir"])
    assert_one_ddp_job(good)
    # The end of the sweep names each failed job and where its logs are.
    out = proc.stdout + proc.stderr
    assert "sweep done: 3 job(s), 2 failed" in out
    for n in ("0", "2"):
        line = next(ln for ln in out.splitlines() if f"FAILED {jobs[n]['job']}" in ln)
        assert "logs:" in line, line
    assert re.search(r"train_rank[01]\.log", jobs["0"]["detail"])  # the worker's own log
    assert any(p.endswith("train.log") for p in jobs["2"]["logs"])


@pytest.mark.slow  # shares the real sweep of test_sweep_failing_jobs_do_not_stop_it
def test_sweep_objective_is_rank0_validation_monitor(sweep) -> None:
    """What Hydra got back from each job (a sweeper's objective) came from the workers: the
    final value of trainer.monitor (val/acc here), as summary.json says too."""
    root, _ = sweep
    jobs = _report(root)
    good = jobs["1"]
    returned = json.loads((Path(good["dir"]) / "job_return.json").read_text())
    assert returned["status"] == "COMPLETED" and returned["return_type"] == "float"
    assert isinstance(good["objective"], float) and math.isfinite(good["objective"])
    s = summary(Path(good["dir"]))
    assert good["objective"] == s["objective"] == s["val_acc"], (good, s)
    assert (good["monitor"], good["mode"], good["status"]) == ("val/acc", "max", "ok")
    assert good["metrics"] == {"val_loss": s["val_loss"], "val_acc": s["val_acc"]}
    # Failed jobs return NaN (a failed trial for Optuna), reported as null.
    assert jobs["0"]["objective"] is None and jobs["2"]["objective"] is None


@pytest.mark.slow  # shares the real sweep of test_sweep_failing_jobs_do_not_stop_it
def test_sweep_names_jobs_by_the_swept_key_and_tabulates_them(sweep) -> None:
    root, proc = sweep
    where = sweep_dir(root)
    jobs = json.loads((where / "sweep_report.json").read_text())
    names = ["0_optim.lr=1e+30", "1_optim.lr=0.001", "2_optim.lr=-1"]  # as Hydra writes 1e30
    assert [j["job"] for j in jobs] == names
    assert sorted(p.name for p in job_dirs(where)) == names  # no fixed override in a name
    assert [j["overrides"] for j in jobs] == [{"optim.lr": n.split("=")[1]} for n in names]
    assert [j["best"] for j in jobs] == [False, True, False]
    best = jobs[1]
    # The log: a summary line naming the best, then an aligned table, one line per job.
    out = (proc.stdout + proc.stderr).splitlines()
    assert any(
        f"objective val/acc (max): best {best['objective']:.6g} ({best['job']})" in ln for ln in out
    )
    header = next(i for i, ln in enumerate(out) if "status job" in ln)
    assert "val/acc (max)" in out[header] and "val_loss" in out[header]
    table = out[header : header + 4]
    starts = {ln.index(f"{j['job']} ") for ln, j in zip(table[1:], jobs)}
    assert starts == {table[0].index("job ")}, table  # aligned
    assert "*" in next(ln for ln in table[1:] if best["job"] in ln)


@pytest.mark.slow  # shares the real sweep of test_sweep_failing_jobs_do_not_stop_it
def test_wandb_api_key_is_never_written_or_printed(sweep) -> None:
    """A key in the environment, W&B offline: nothing the sweep writes (logs, .hydra/ dumps,
    stats, reports, W&B files and config) nor prints contains it."""
    root, proc = sweep
    assert FAKE_KEY not in proc.stdout + proc.stderr
    written = [p for p in root.rglob("*") if p.is_file()]
    assert len(written) > 10 and any(p.suffix == ".wandb" for p in written)
    leaks = [str(p) for p in written if FAKE_KEY.encode() in p.read_bytes()]
    assert not leaks, f"the API key was written to {leaks}"


@pytest.mark.slow  # shares the real sweep of test_sweep_failing_jobs_do_not_stop_it
def test_plot_run_overlays_the_jobs_of_a_sweep(sweep, tmp_path: Path) -> None:
    """scripts/plot_run.py on the sweep dir (its main, in process): one PNG per stat, a line
    per job that logged stats (#2 never trained), each the mean over the job's ranks."""
    root, _ = sweep
    sys.path.insert(0, str(PLOT.parent))
    import plot_run

    plots = tmp_path / "plots"
    where = sweep_dir(root)
    assert plot_run.main([str(where), "--out", str(plots), "--stats", "loss,rss_mb"]) == 0
    for stat in ("loss", "rss_mb"):
        data = (plots / f"{stat}.png").read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000
    jobs = plot_run.read_sweep_stats(where)
    assert list(jobs) == ["0_optim.lr=1e+30", "1_optim.lr=0.001"]
    ranks = jobs["1_optim.lr=0.001"]
    assert sorted(ranks) == [0, 1]
    line = plot_run.across_ranks(ranks, "loss")
    mean = [(a[0], (a[1] + b[1]) / 2) for a, b in zip(ranks[0]["loss"], ranks[1]["loss"])]
    assert [p[0] for p in line] == [p[0] for p in mean] == list(range(1, 21))
    assert [p[1] for p in line] == pytest.approx([p[1] for p in mean])


@pytest.mark.slow  # shares the real sweep of test_sweep_failing_jobs_do_not_stop_it
def test_sweep_each_job_is_its_own_wandb_run_in_one_group(sweep) -> None:
    root, _ = sweep
    jobs = _report(root)
    infos = {}
    for n in ("0", "1"):  # job 2 never started a worker, so it has no run
        runs = sorted(Path(jobs[n]["dir"]).glob("wandb/offline-run-*/run-*.wandb"))
        assert len(runs) == 1, (n, runs)
        infos[n] = (wandb_records.run_info(runs[0]), wandb_records.exit_code(runs[0]))
    assert not list(Path(jobs["2"]["dir"]).glob("wandb"))
    (fail, fail_exit), (good, good_exit) = infos["0"], infos["1"]
    assert fail["id"] != good["id"] and fail["name"] != good["name"]
    sweep_name = "-".join(sweep_dir(root).parts[-2:])
    assert fail["group"] == good["group"] == f"sweep-{sweep_name}"
    assert good_exit == 0 and fail_exit != 0


# --------------------------------------------------------------------------------------------
# d: two "nodes"
# --------------------------------------------------------------------------------------------


def _agent(cmd: list[str], cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)


def _wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:  # only the processes this test started
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    if codes != [0] * len(procs):
        tails = "\n".join(
            f"--- {log.name} (exit {c})\n{log.read_text()[-4000:]}" for log, c in zip(logs, codes)
        )
        pytest.fail(f"agents exited {codes}\n{tails}")


def _two_agents(
    tmp: Path, env: dict[str, str], *args: str, overrides: tuple[str, ...] = ()
) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=localhost:{ranks.free_port()}",
        f"--rdzv-id=two-nodes-{tmp.name}",
        *args,
        "-m",
        "hydra_ddp.train",
        *TINY,
        *overrides,
    ]
    logs = [tmp / "node0.log", tmp / "node1.log"]
    first = _agent(cmd, tmp, env, logs[0])
    time.sleep(2)
    second = _agent(cmd, tmp, env, logs[1])
    _wait_all([first, second], logs, timeout=150)


@pytest.mark.slow
def test_two_agents_c10d_rendezvous_one_job_dir(tmp_path: Path) -> None:
    """Two torchrun agents ("nodes") with the same --rdzv-id, started 2 s apart, form one
    2-rank job; both ranks write into the dir rank 0 chose."""
    _two_agents(tmp_path, user_env(tmp_path))
    job = only_job_dir(tmp_path)
    assert_one_ddp_job(job)
    assert len(hydra_dumps(tmp_path)) == 1
    assert [p for p in tmp_path.rglob("summary.json") if p.parent.name != "stats"] == [
        job / "summary.json"
    ]


# --------------------------------------------------------------------------------------------
# e: SLURM's code path through submitit's local executor
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_submitit_local_two_tasks_one_job(tmp_path: Path) -> None:
    ok(
        python_train(
            tmp_path,
            "-m",
            "hydra/launcher=submitit_local",
            "hydra.launcher.tasks_per_node=2",
            "hydra.launcher.timeout_min=5",
            *TINY,
            timeout=150,
        )
    )
    sweep = sweep_dir(tmp_path)
    dirs = job_dirs(sweep)
    assert len(dirs) == 1, dirs
    s = assert_one_ddp_job(dirs[0])
    assert len(hydra_dumps(tmp_path)) == 1
    report = json.loads((sweep / "sweep_report.json").read_text())
    assert [j["status"] for j in report] == ["ok"]
    # Task 0 is rank 0: its return value is the job's objective.
    assert report[0]["objective"] == pytest.approx(s["objective"], abs=0)
    # Both tasks ran the job (task k = rank k), each logging to its own file.
    for rank in (0, 1):
        text = (dirs[0] / f"train_rank{rank}.log").read_text()
        assert f"rank={rank}/2" in text, text


@pytest.mark.parametrize(
    "preset,tasks,gpus", [("slurm", 8, 8), ("slurm_cpu", 4, None), ("local", 2, None)]
)
def test_launcher_presets_compose(preset: str, tasks: int, gpus: int | None) -> None:
    from hydra import compose, initialize_config_dir

    from hydra_ddp.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"hydra/launcher={preset}"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher.tasks_per_node == tasks and launcher.gpus_per_node == gpus
    assert launcher._target_.endswith("LocalLauncher" if preset == "local" else "SlurmLauncher")
    if preset == "slurm":  # one task per GPU follows gpus_per_node
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose(
                "train",
                overrides=["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=4"],
                return_hydra_config=True,
            )
        assert cfg.hydra.launcher.tasks_per_node == 4


# --------------------------------------------------------------------------------------------
# Restarts (slow: a worker dies, the whole group starts again)
# --------------------------------------------------------------------------------------------

# Rank 1 dies in the first attempt once it gets to the process group (after Hydra made the dir
# and while rank 0 waits in init_process_group); the agent then restarts both.
FAIL_ONCE = """\
import os
if os.environ.get("HYDRA_DDP_TEST_FAIL_ONCE"):
    import time
    import torch.distributed as _dist
    _init = _dist.init_process_group
    def _init_or_die(*args, **kwargs):
        if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            time.sleep(3)
            os._exit(7)
        return _init(*args, **kwargs)
    _dist.init_process_group = _init_or_die
"""


def _fail_once_env(tmp: Path, **extra: str) -> dict[str, str]:
    inject = tmp / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(FAIL_ONCE)
    env = user_env(tmp, HYDRA_DDP_TEST_FAIL_ONCE="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(inject), env["PYTHONPATH"]])
    return env


@pytest.mark.slow
def test_self_launch_restart_reuses_the_job(tmp_path: Path) -> None:
    proc = ok(
        python_train(
            tmp_path,
            "dist.nproc_per_node=2",
            "dist.max_restarts=1",
            "dist.timeout_s=60",
            *TINY,
            env=_fail_once_env(tmp_path),
            timeout=200,
        )
    )
    assert "exitcode: 7" in proc.stdout + proc.stderr  # the first attempt did fail
    assert_one_ddp_job(only_job_dir(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("store", ["agent", "per_attempt"])
def test_torchrun_restart_reuses_the_job_dir(tmp_path: Path, store: str) -> None:
    """torchrun --max-restarts: the restarted group writes into the first attempt's dir.

    agent: torch's default, the agent's store outlives the restart and still holds rank 0's
    timestamped dir. per_attempt: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (what docs/scaling_out.md
    advises with restarts, see torch#135712): no store outlives an attempt, so the dir is named
    by the run id, which does."""
    extra = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if store == "per_attempt" else {}
    proc = ok(
        torchrun(
            tmp_path,
            *TINY,
            "dist.timeout_s=60",
            nproc=2,
            env=_fail_once_env(tmp_path, **extra),
            timeout=200,
            extra_args=("--max-restarts=1",),
        )
    )
    assert "exitcode: 7" in proc.stdout + proc.stderr  # the first attempt did fail
    job = only_job_dir(tmp_path)
    if store == "per_attempt":
        assert job.parent.name == "torchrun", job
    else:
        assert job.parent.parent.name == "outputs" and job.name.count("-") == 2, job
    assert_one_ddp_job(job)


@pytest.mark.slow
def test_two_agents_restart_with_a_store_per_attempt(tmp_path: Path) -> None:
    """Several nodes with --max-restarts, as docs/scaling_out.md says to run them. The agents'
    restart counts differ here (only the failed rank's agent counts a restart), so nothing may
    depend on them agreeing."""
    env = _fail_once_env(tmp_path, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    _two_agents(tmp_path, env, "--max-restarts=1", overrides=("dist.timeout_s=60",))
    logs = (tmp_path / "node0.log").read_text() + (tmp_path / "node1.log").read_text()
    assert "exitcode: 7" in logs
    job = only_job_dir(tmp_path)
    assert job.parent.name == "torchrun", job
    assert_one_ddp_job(job)


# --------------------------------------------------------------------------------------------
# The resolvers, in process
# --------------------------------------------------------------------------------------------

_LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@pytest.fixture
def clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No launcher variables for the test; the environment as it was afterwards. Run in
    tmp_path: resolving a job dir creates it."""
    from hydra_ddp.rundir import paths as hdist

    monkeypatch.chdir(tmp_path)
    saved = dict(os.environ)
    for key in list(os.environ):
        if key.startswith(("TORCHELASTIC_", "SLURM_", "SUBMITIT_")) or key in _LAUNCH_VARS:
            del os.environ[key]
    hdist.job_dir.cache_clear()
    hdist.hydra_subdir.cache_clear()
    yield
    os.environ.clear()
    os.environ.update(saved)
    hdist.job_dir.cache_clear()
    hdist.hydra_subdir.cache_clear()


def test_job_dir_agreed_through_agent_store_and_kept_across_restarts(clean_env) -> None:
    import torch.distributed as dist

    from hydra_ddp.rundir.paths import job_dir

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    os.environ.update(
        TORCHELASTIC_RUN_ID="run-a",
        TORCHELASTIC_USE_AGENT_STORE="True",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(server.port),
    )

    def resolve(rank: int, default: str) -> str:
        os.environ["RANK"] = str(rank)
        job_dir.cache_clear()  # a fresh worker process
        return job_dir(default)

    # Rank 0's choice wins whatever the other ranks' clocks say (rank 1 would wait for it).
    assert resolve(0, "outputs/d/10-00-00") == "outputs/d/10-00-00"
    assert resolve(1, "outputs/d/10-00-02") == "outputs/d/10-00-00"
    # A restarted worker group (new timestamps) keeps the first attempt's dir.
    assert resolve(0, "outputs/d/10-05-00") == "outputs/d/10-00-00"
    assert resolve(1, "outputs/d/10-05-01") == "outputs/d/10-00-00"
    # Another run on the same store gets its own.
    os.environ["TORCHELASTIC_RUN_ID"] = "run-b"
    assert resolve(0, "outputs/d/11-00-00") == "outputs/d/11-00-00"


def test_job_dir_without_agent_store_or_launcher(clean_env) -> None:
    from hydra_ddp.rundir.paths import job_dir

    assert job_dir("outputs/d/t") == "outputs/d/t"
    job_dir.cache_clear()
    os.environ.update(TORCHELASTIC_RUN_ID="4242", TORCHELASTIC_USE_AGENT_STORE="False", RANK="3")
    assert job_dir("outputs/d/t") == os.path.join("outputs", "torchrun", "4242")


@pytest.mark.parametrize(
    "env,rank",
    [
        ({}, 0),
        ({"RANK": "1"}, 1),
        ({"SLURM_PROCID": "3"}, 3),
        ({"SUBMITIT_LOCAL_GLOBALID": "1"}, 1),
        ({"RANK": "0", "SLURM_PROCID": "5"}, 0),  # torchrun inside an srun task: RANK wins
    ],
)
def test_only_global_rank0_dumps_hydra(clean_env, env: dict, rank: int) -> None:
    from hydra_ddp.rundir.paths import hydra_subdir

    os.environ.update(env)
    assert hydra_subdir(".hydra", "out") == (".hydra" if rank == 0 else None)


def test_a_later_run_in_a_dir_keeps_the_first_runs_hydra_dump(clean_env, tmp_path: Path) -> None:
    from hydra_ddp.rundir.paths import hydra_subdir

    (tmp_path / "run" / ".hydra").mkdir(parents=True)
    assert hydra_subdir(".hydra", str(tmp_path / "run")) == ".hydra.2"
    (tmp_path / "run" / ".hydra.2").mkdir()
    hydra_subdir.cache_clear()  # a new process
    assert hydra_subdir(".hydra", str(tmp_path / "run")) == ".hydra.3"


def test_same_second_job_dirs_are_claimed_in_turn(clean_env) -> None:
    from hydra_ddp.rundir.paths import claim_dir

    assert claim_dir("outputs/d/10-00-00") == "outputs/d/10-00-00"
    assert claim_dir("outputs/d/10-00-00") == "outputs/d/10-00-00-2"
    assert claim_dir("outputs/d/10-00-00") == "outputs/d/10-00-00-3"
    assert sorted(os.listdir("outputs/d")) == ["10-00-00", "10-00-00-2", "10-00-00-3"]


@pytest.mark.parametrize(
    "env,name",
    [
        ({}, "train"),
        ({"RANK": "1"}, "train_rank1"),
        ({"RANK": "0"}, "train_rank0"),
        (
            {
                "SUBMITIT_EXECUTOR": "local",
                "SUBMITIT_LOCAL_NTASKS": "2",
                "SUBMITIT_LOCAL_GLOBALID": "1",
            },
            "train_rank1",
        ),
        (
            {
                "SUBMITIT_EXECUTOR": "local",
                "SUBMITIT_LOCAL_NTASKS": "1",
                "SUBMITIT_LOCAL_GLOBALID": "0",
            },
            "train",
        ),
    ],
)
def test_each_rank_logs_to_its_own_file(clean_env, tmp_path, env: dict, name: str) -> None:
    from hydra_ddp.rundir.paths import log_file

    os.environ.update(env)
    assert log_file(str(tmp_path), "train") == str(tmp_path / f"{name}.log")


def test_submitit_task_exports_torchrun_style_env(clean_env) -> None:
    from hydra_ddp.config import Device, DistConfig
    from hydra_ddp.distributed import env_from_environ
    from hydra_ddp.launcher_env import export_submitit_env, under_launcher

    os.environ.update(
        SUBMITIT_EXECUTOR="local",
        SUBMITIT_LOCAL_NTASKS="2",
        SUBMITIT_LOCAL_JOB_NUM_NODES="1",
        SUBMITIT_LOCAL_NODEID="0",
        SUBMITIT_LOCAL_GLOBALID="1",
        SUBMITIT_LOCAL_LOCALID="1",
        SUBMITIT_LOCAL_JOB_ID="12345",
    )
    assert under_launcher()
    export_submitit_env()
    assert os.environ["RANK"] == "1" and os.environ["WORLD_SIZE"] == "2"
    assert os.environ["LOCAL_RANK"] == "1" and os.environ["LOCAL_WORLD_SIZE"] == "2"
    assert os.environ["MASTER_ADDR"] == socket.gethostname()
    # Below Linux's ephemeral ports (32768-60999), which any socket bound to port 0 may take,
    # and the same for every task of the job.
    port = int(os.environ["MASTER_PORT"])
    assert 20000 <= port < 32768
    env = env_from_environ(DistConfig(device=Device.cpu))
    assert (env.rank, env.world_size, env.local_rank) == (1, 2, 1)
    # Idempotent: a second call (e.g. a requeued task) leaves the variables alone.
    export_submitit_env()
    assert os.environ["RANK"] == "1"
    # Rank 0's task of the same job hosts the group on the same port.
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        del os.environ[key]
    del os.environ["MASTER_PORT"]
    os.environ.update(SUBMITIT_LOCAL_GLOBALID="0", SUBMITIT_LOCAL_LOCALID="0")
    export_submitit_env()
    assert os.environ["RANK"] == "0" and int(os.environ["MASTER_PORT"]) == port

    # A MASTER_PORT the user set is respected (submitit's own export refuses to run with it).
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        del os.environ[key]
    os.environ["MASTER_PORT"] = "29555"
    export_submitit_env()
    assert os.environ["MASTER_PORT"] == "29555" and os.environ["RANK"] == "0"


def test_the_slurm_preset_asks_for_the_signal_requeues_and_cpus() -> None:
    """The sbatch text submitit writes for the `slurm` preset (nothing submitted): its time-limit
    signal, requeue on time-out, and CPUs per task."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from submitit.slurm.slurm import _make_sbatch_string

    from hydra_ddp.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher["max_num_timeout"] > 0  # submitit requeues on its time-limit signal
    text = _make_sbatch_string(
        command="python -m hydra_ddp.train",
        folder="/tmp/submitit/%j",
        job_name="hydra-ddp",
        partition="gpu",
        time=launcher["timeout_min"],
        nodes=launcher["nodes"],
        ntasks_per_node=launcher["tasks_per_node"],
        cpus_per_task=launcher["cpus_per_task"],
        gpus_per_node=launcher["gpus_per_node"],
        signal_delay_s=launcher["signal_delay_s"],
    )
    assert f"#SBATCH --signal=USR2@{launcher['signal_delay_s']}" in text
    assert f"#SBATCH --cpus-per-task={launcher['cpus_per_task']}" in text
    assert f"--ntasks-per-node={launcher['tasks_per_node']}" in text


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_submitit_sweep_survives_the_time_limit_signal(tmp_path: Path) -> None:
    """submitit's USR2 to the first job's tasks: every rank checkpoints, submitit requeues the
    job (max_num_timeout > 0 in the presets), the requeued job resumes and finishes, and the
    sweep ends with a report listing both jobs, the first requeued."""
    cmd = [
        sys.executable, "-m", "hydra_ddp.train", "-m", "hydra/launcher=local",
        "hydra.launcher.tasks_per_node=2", "dist.device=cpu", *FAST, "trainer.max_steps=300",
        "trainer.log_interval=20", "trainer.seed=1,2",
    ]  # fmt: skip
    env = user_env(tmp_path)
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        stats = None
        while stats is None or stats.read_text().count("\n") < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            found = list(tmp_path.glob("multirun/*/*/0_*/stats/rank0.jsonl"))
            stats = found[0] if found else None
            time.sleep(0.3)
        job_dir = stats.parent.parent
        import psutil

        tasks = [
            p for p in psutil.process_iter(["cmdline", "environ"])
            if "submitit.core._submit" in " ".join(p.info["cmdline"] or [])
            and str(job_dir.parent) in " ".join(p.info["cmdline"] or [])
            and (p.info["environ"] or {}).get("SUBMITIT_LOCAL_JOB_ID")
        ]  # fmt: skip
        first_job = min(p.info["environ"]["SUBMITIT_LOCAL_JOB_ID"] for p in tasks)
        for p in tasks:  # SLURM signals every task of the job
            if p.info["environ"]["SUBMITIT_LOCAL_JOB_ID"] == first_job:
                p.send_signal(signal.SIGUSR2)
        out, _ = proc.communicate(timeout=480)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    # A sweep over seeds: its jobs beside its seed group.
    report = json.loads(next(tmp_path.glob("multirun/*/*/sweep_report.json")).read_text())["jobs"]
    assert [j["status"] for j in report] == ["ok", "ok"], report
    assert report[0]["requeued"] == 1 and report[1]["requeued"] == 0, report
    logs = (job_dir / "train_rank0.log").read_text()
    assert "stopped on SIGUSR2 at step" in logs and "resumed from" in logs
    assert json.loads((job_dir / "summary.json").read_text())["steps"] == 300
