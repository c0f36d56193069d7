"""hydra_ddp.tracking end to end: real gloo ranks (helpers/ranks.py), real offline W&B runs.

Every W&B setting a test needs goes into the environment of its call only (helpers/ranks.py
puts the environment back afterwards and starts W&B afresh); W&B's config, cache and netrc are
pointed into tmp_path so nothing on this machine (a real login included) changes the outcome,
and W&B never goes online. The rank functions are in helpers/_tracking_worker.py.
"""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
from conftest import REPO, user_env, wandb_env
from helpers import ranks, wandb_records
from helpers._tracking_worker import STEPS, resume_attempt, run_job, sequential
from helpers.inproc import job, train_ranks

from hydra_ddp.config import WandbMode
from hydra_ddp.distributed import DistEnv
from hydra_ddp.errors import UserError
from hydra_ddp.tracking.names import STEP_METRIC as STEP
from hydra_ddp.tracking.wandb_mode import resolve_mode

PLOT = REPO / "scripts" / "plot_run.py"
# 40 hex chars, the shape of a real key; made at run time, so that no file holds it (a job
# records the checkout's uncommitted changes, this file among them).
FAKE_KEY = hashlib.sha1(b"hydra-ddp tests: not a W&B key").hexdigest()
SHARED_MSG = "logger.layout=shared needs W&B online ("
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

sys.path.insert(0, str(PLOT.parent))
import plot_run  # noqa: E402  (scripts/plot_run.py, its main called in process)


def _env(tmp: Path, **extra: Optional[str]) -> dict[str, Optional[str]]:
    """A call's environment with W&B isolated under ``tmp`` and forced offline."""
    return wandb_env(
        tmp,
        **{"WANDB_MODE": "offline", "WANDB_ARTIFACT_DIR": str(tmp / "wandb-artifacts"), **extra},
    )


def _on_two_ranks(tmp: Path, out: Path, env: Optional[dict] = None, **job: object):
    """`run_job` on 2 gloo ranks: each rank's result, with `.logs` and `.outputs`."""
    return ranks.run(run_job, out, env=env or _env(tmp), **job)


def _runs(out: Path) -> list[Path]:
    return sorted(out.glob("wandb/offline-run-*/run-*.wandb"))


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check_rank_files(out: Path) -> None:
    for rank in (0, 1):
        lines = _jsonl(out / "stats" / f"rank{rank}.jsonl")
        assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
        assert all(r["rank"] == rank and "time" in r and "loss" in r for r in lines)
        assert lines[-1]["samples_seen"] == 64 * STEPS  # integers stay integers
    agg = _jsonl(out / "stats" / "aggregate.jsonl")
    assert len(agg) == STEPS
    assert all(a["slowest_rank"] == 1 and a["data_wait_slowest_rank"] == 0 for a in agg)
    assert all(a["step_time_min"] < a["step_time_mean"] < a["step_time_max"] for a in agg)


@pytest.fixture(scope="module")
def gather_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("gather")
    out = tmp / "out"
    _on_two_ranks(tmp, out, layout="gather")
    return out


def test_gather_layout_one_run_with_every_rank(gather_run: Path) -> None:
    out = gather_run
    runs = _runs(out)
    assert len(runs) == 1, runs
    info = wandb_records.run_info(runs[0])
    assert info["name"] == "train" and info["group"] == "test-group"
    assert info["project"] == "hydra-ddp-tests" and set(info["tags"]) == {"test", "worker"}
    assert info["config"] == {"trainer": {"batch_size": 64, "lr": 0.1}, "job": "train"}
    assert wandb_records.exit_code(runs[0]) == 0

    rows = wandb_records.history_rows(runs[0])
    train = [r for r in rows if "rank0/loss" in r]
    assert [r["trainer/step"] for r in train] == list(range(1, STEPS + 1))
    for row in train:
        assert {
            "rank1/loss",
            "rank0/rss_mb",
            "rank1/data_wait",
            "agg/step_time_max",
            "agg/step_time_mean",
            "agg/data_wait_min",
        } <= row.keys()
        assert row["rank1/step_time"] > row["rank0/step_time"]
        assert row["agg/slowest_rank"] == 1
        assert row["agg/step_time_max"] == pytest.approx(row["rank1/step_time"])
    evals = [r for r in rows if "val/acc" in r]
    assert len(evals) == 1 and evals[0]["trainer/step"] == STEPS

    defs = wandb_records.metric_definitions(runs[0])
    for family in ("rank0/*", "rank1/*", "agg/*", "val/*", "test/*"):
        assert defs.get(family) == "trainer/step", defs

    _check_rank_files(out)
    assert _jsonl(out / "stats" / "eval.jsonl")[0]["val/acc"] == 0.5
    assert json.loads((out / "stats" / "summary.json").read_text()) == {"test/acc": 0.9}


def test_wandb_rows_rate_limited_local_copy_complete(tmp_path: Path) -> None:
    # With logger.min_interval_s far above the job's length, W&B gets the first training row
    # and (at close) the last one; the JSON-lines copy and the aggregates keep every interval.
    out = tmp_path / "out"
    _on_two_ranks(tmp_path, out, layout="gather", min_interval=3600.0)
    runs = _runs(out)
    assert len(runs) == 1, runs
    rows = wandb_records.history_rows(runs[0])
    train = [r for r in rows if "rank0/loss" in r]
    assert [r["trainer/step"] for r in train] == [1, STEPS]
    assert train[-1]["rank1/step_time"] == pytest.approx(0.10 + 0.05 + 0.001 * STEPS)
    assert train[-1]["agg/slowest_rank"] == 1
    assert [r["trainer/step"] for r in rows if "val/acc" in r] == [STEPS]
    _check_rank_files(out)


def test_plot_run_draws_per_rank_pngs(gather_run: Path, tmp_path: Path, capsys) -> None:
    plots = tmp_path / "plots"
    assert plot_run.main([str(gather_run), "--out", str(plots)]) == 0
    for stat in ("loss", "step_time", "data_wait", "rss_mb", "samples_per_s"):
        data = (plots / f"{stat}.png").read_bytes()
        assert data.startswith(PNG_MAGIC) and data[12:16] == b"IHDR" and len(data) > 5000
    # cuda_mem_mb is all zero on CPU, so there is nothing to show.
    assert not (plots / "cuda_mem_mb.png").exists()
    assert str(plots / "loss.png") in capsys.readouterr().out.split()


def test_plot_run_without_stats_exits_2(tmp_path: Path, capsys) -> None:
    assert plot_run.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "no stats files found" in err


def test_group_layout_one_run_per_rank(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _on_two_ranks(tmp_path, out, layout="group")
    infos = {}
    for path in _runs(out):
        info = wandb_records.run_info(path)
        infos[info["job_type"]] = (info, wandb_records.history_rows(path), path)
    assert sorted(infos) == ["rank0", "rank1"]
    groups = {info["group"] for info, _, _ in infos.values()}
    assert groups == {"test-group"}  # the job's (a sweep's jobs: the sweep's)
    for rank in (0, 1):
        info, rows, path = infos[f"rank{rank}"]
        assert info["name"] == f"train-rank{rank}"
        assert wandb_records.exit_code(path) == 0
        train = [r for r in rows if "train/loss" in r]
        assert [r["trainer/step"] for r in train] == list(range(1, STEPS + 1))
        assert not any(k.startswith("rank") for r in rows for k in r)
        has_agg = any(k.startswith("agg/") for r in rows for k in r)
        assert has_agg == (rank == 0)  # aggregates live in rank 0's run only
    _check_rank_files(out)


def test_shared_layout_offline_fails_on_every_rank(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # mode=auto with no credentials anywhere resolves to offline.
    done = ranks.run(
        run_job,
        out,
        layout="shared",
        mode="auto",
        env=_env(tmp_path, WANDB_MODE=None),
        return_exceptions=True,
    )
    for error in done:  # each rank on its own, before any collective
        assert isinstance(error, UserError), error
        message = str(error)
        assert message.startswith(SHARED_MSG) and "\n" not in message
        assert "use logger.layout=gather or group, or log in" in message
    assert not (out / "wandb").exists() and not _runs(out)


@pytest.mark.slow
def test_backend_none_writes_jsonl_only(tmp_path: Path) -> None:
    """In fresh processes: with logger=none (no logger.sink) nothing imports W&B."""
    out = tmp_path / "out"
    done = ranks.run(run_job, out, logger="none", env=_env(tmp_path), fresh=True)
    assert list(done) == [{"wandb_imported": False}] * 2
    _check_rank_files(out)
    assert not any(p.name == "wandb" for p in tmp_path.rglob("*")), "a wandb dir was created"


def test_sequential_trackers_in_one_process(tmp_path: Path) -> None:
    # Hydra's basic launcher runs a sweep's jobs one after another in one process.
    out = tmp_path / "out"
    ranks.run(sequential, out, world_size=1, group=False, env=_env(tmp_path))
    ids = []
    for job_name, want_exit in (("job0", 0), ("job1", 1)):
        runs = _runs(out / job_name)
        assert len(runs) == 1, runs
        info = wandb_records.run_info(runs[0])
        assert info["name"] == job_name
        assert wandb_records.exit_code(runs[0]) == want_exit  # finished, failed one marked
        assert len([r for r in wandb_records.history_rows(runs[0]) if "rank0/loss" in r]) == STEPS
        ids.append(info["id"])
    assert ids[0] != ids[1]


def test_api_key_never_lands_in_output_dir(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # group layout: both ranks write a run; the key also goes into the config.
    done = _on_two_ranks(
        tmp_path, out, _env(tmp_path, WANDB_API_KEY=FAKE_KEY), layout="group", leak_key=FAKE_KEY
    )
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(_runs(out)) == 2 and len(files) > 10
    leaked = [p for p in files if FAKE_KEY.encode() in p.read_bytes()]
    assert not leaked, leaked
    assert all(FAKE_KEY not in text for text in [*done.outputs, *done.logs])
    config = wandb_records.run_info(_runs(out)[0])["config"]
    assert config["logger"] == {"api_key": "<redacted>"}
    assert config["note"] == "run with key <redacted>"


@pytest.mark.parametrize(
    "setup, auto",
    [
        ("nothing", "offline"),
        ("api_key", "online"),
        ("netrc", "online"),
        ("netrc_other_host", "offline"),
        ("wandb_mode", "offline"),
    ],
)
def test_auto_mode_resolution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setup: str, auto: str
) -> None:
    """What logger.mode=auto resolves to from the environment and the netrc (no network)."""
    netrc = tmp_path / "netrc"
    for key, value in _env(tmp_path, NETRC=str(netrc), WANDB_MODE=None).items():
        monkeypatch.delenv(key, raising=False)
        if value is not None:
            monkeypatch.setenv(key, value)
    for key in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_DISABLED", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc of this machine's user
    if setup == "api_key":
        monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    elif setup == "netrc":
        netrc.write_text(f"machine api.wandb.ai\n  login user\n  password {FAKE_KEY}\n")
    elif setup == "netrc_other_host":
        netrc.write_text(f"machine example.com\n  login user\n  password {FAKE_KEY}\n")
    elif setup == "wandb_mode":
        monkeypatch.setenv("WANDB_MODE", "offline")
        monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    if netrc.exists():
        netrc.chmod(0o600)
    modes = {m: resolve_mode(WandbMode(m)) for m in ("auto", "offline")}
    assert {m: mode for m, (mode, _) in modes.items()} == {"auto": auto, "offline": "offline"}
    assert all(FAKE_KEY not in reason for _, reason in modes.values())
    if auto == "online" or setup == "wandb_mode":
        assert resolve_mode(WandbMode.online)[0] == "online"
    else:
        # Online without a login would prompt on a terminal: one line instead, at once.
        with pytest.raises(UserError, match=r"logger.mode=online but W&B has no login for"):
            resolve_mode(WandbMode.online)


def test_auto_mode_finds_the_login_wandb_login_writes(tmp_path: Path, monkeypatch) -> None:
    """`wandb login` (the CLI of the installed W&B, told not to ask the server) writes a netrc
    entry for the host W&B uses by default, whatever W&B calls it: auto goes online, online
    starts."""
    env = user_env(tmp_path, HOME=str(tmp_path), NETRC=str(tmp_path / ".netrc"))
    cli = [sys.executable, "-m", "wandb", "login", "--no-verify", FAKE_KEY]
    done = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=120)
    assert (tmp_path / ".netrc").is_file(), done.stdout + done.stderr
    for key in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_MODE"):
        monkeypatch.delenv(key, raising=False)
    for key in ("HOME", "NETRC", "WANDB_CONFIG_DIR"):
        monkeypatch.setenv(key, env[key])
    monkeypatch.chdir(tmp_path)
    mode, reason = resolve_mode(WandbMode.auto)
    assert mode == "online" and FAKE_KEY not in reason, reason
    assert resolve_mode(WandbMode.online)[0] == "online"


def test_auto_mode_finds_a_self_hosted_login(tmp_path: Path, monkeypatch) -> None:
    """`wandb login --host` keeps the host in W&B's settings file, not in WANDB_BASE_URL: auto
    reads it there, and finds that host's netrc entry (without contacting it)."""
    for key in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_MODE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    config_dir = tmp_path / "wandb-config"
    config_dir.mkdir()
    (config_dir / "settings").write_text("[default]\nbase_url = https://wandb.example.org\n")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(config_dir))
    netrc = tmp_path / ".netrc"
    netrc.write_text(f"machine wandb.example.org\n  login user\n  password {FAKE_KEY}\n")
    netrc.chmod(0o600)
    monkeypatch.delenv("NETRC", raising=False)
    mode, reason = resolve_mode(WandbMode.auto)
    assert mode == "online" and "wandb.example.org" in reason and FAKE_KEY not in reason
    # Windows' name for it works too.
    netrc.rename(tmp_path / "_netrc")
    assert resolve_mode(WandbMode.auto)[0] == "online"
    # Without the settings file the default host has no entry: offline.
    (config_dir / "settings").unlink()
    assert resolve_mode(WandbMode.auto)[0] == "offline"


# --------------------------------------------------------------------------------------------
# W&B failures through the entry point: bounded, one line, the advice right for the mode
# --------------------------------------------------------------------------------------------


def _closed_port() -> int:
    """A local port nothing listens on: W&B's server there is out of reach at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_alone(env: DistEnv, cfg, run) -> dict:
    """The loop as `python -m hydra_ddp.train` runs it alone: one process, no process group."""
    from helpers.inproc import train

    return train(cfg, DistEnv(), run)


def _fails_alone(tmp_path: Path, env: dict, *overrides: str) -> tuple[str, ranks.Results]:
    """A one-process job in a process of helpers/ranks.py that must fail with a one-line
    UserError: that line, and what the process printed and logged."""
    cfg, run = job(tmp_path / "job", *overrides)
    done = ranks.run(
        _train_alone, cfg, run, world_size=1, group=False, env=env, return_exceptions=True
    )
    assert isinstance(done[0], UserError), done[0]
    line = str(done[0])
    assert "\n" not in line, line
    return line, done


# Both modes wait out the init timeout: the slow set. (A W&B init that fails fast stops every
# rank in the default suite: test_wandb_init_failing_on_rank_0_stops_every_rank_at_once.)
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["online", "auto"])
def test_wandb_unreachable_fails_within_the_init_timeout(tmp_path: Path, mode: str) -> None:
    """A key but no server (WANDB_BASE_URL on a closed local port): the job stops after the
    init timeout with one line saying what to do, and the key is written nowhere."""
    env = wandb_env(
        tmp_path,
        WANDB_API_KEY=FAKE_KEY,
        WANDB_BASE_URL=f"http://127.0.0.1:{_closed_port()}",
        WANDB_INIT_TIMEOUT="3",
    )
    t0 = time.monotonic()
    line, done = _fails_alone(
        tmp_path,
        env,
        "logger=wandb",
        f"logger.mode={mode}",
        "trainer.progress=false",
        "trainer.max_steps=3",
    )
    elapsed = time.monotonic() - t0
    assert "W&B could not be reached within 3 s (WANDB_INIT_TIMEOUT;" in line, line
    assert "logger.mode=offline" in line and "wandb sync " in line, line
    assert elapsed < 60, elapsed  # 3 s, plus start-up on a busy machine; W&B's own: 96 s
    assert FAKE_KEY not in line + done.outputs[0] + done.logs[0]
    leaks = [p for p in tmp_path.rglob("*") if p.is_file() and FAKE_KEY.encode() in p.read_bytes()]
    assert not leaks, f"the API key was written to {leaks}"


@pytest.mark.parametrize("project", ["x" * 300, "team/project"])
def test_wandb_bad_project_offline_is_one_short_line(tmp_path: Path, project: str) -> None:
    """Offline already: the advice is to fix the name, not to go offline; a long name is cut."""
    line, _ = _fails_alone(
        tmp_path,
        wandb_env(tmp_path),
        "logger=wandb",
        "logger.mode=offline",
        f"logger.project={project}",
        "trainer.progress=false",
        "trainer.max_steps=3",
    )
    assert "W&B could not start a run for logger.project=" in line, line
    assert "fix logger.project" in line and "logger.mode=offline" not in line, line
    assert len(line) < 500, len(line)
    assert project[:40] in line  # enough of the name to recognise it


# --------------------------------------------------------------------------------------------
# One job, one set of W&B runs across restarts (offline: each attempt is its own offline-run-*
# dir under the same run id; read back, their records continue one another)
# --------------------------------------------------------------------------------------------


def _files_by_id(out: Path) -> dict[str, list[Path]]:
    """Each W&B run id of a job and its attempts' .wandb files, oldest attempt first.

    By the run record's start time, not the dir name: W&B names a second attempt that starts
    in the same second ``offline-run-<time>-<id>-1``, which sorts before the first."""
    started = []
    for path in _runs(out):
        (record,) = _run_records(path)
        started.append((record.start_time.ToNanoseconds(), record.run_id, path))
    by_id: dict[str, list[Path]] = {}
    for _, run_id, path in sorted(started):
        by_id.setdefault(run_id, []).append(path)
    return by_id


def _steps(files: list[Path], key: str) -> list[int]:
    """trainer/step of every row holding `key`, across the attempts, in the order logged."""
    return [r["trainer/step"] for f in files for r in wandb_records.history_rows(f) if key in r]


def _run_records(path: Path):
    return [r.run for r in wandb_records.read_records(path) if r.WhichOneof("record_type") == "run"]


def _tagged(path: Path) -> list[str]:
    """The W&B run each row of a stats file went to, in order."""
    return [row["run"] for row in _jsonl(path)]


def test_resumed_tracker_continues_its_run_and_never_resends_a_step(tmp_path: Path) -> None:
    """One process, layout=gather: killed after sending step 8 but checkpointed at 6, the job
    resumes the run its stats name (same id and group) and sends only what W&B lacks; after
    trainer.resume=never set those stats aside, a job from step 0 in that dir gets a new run."""
    from hydra_ddp.tracking import set_aside_stats

    out = tmp_path / "out"

    def attempt(name: str, first: int, last: int, resumed: Optional[int]) -> None:
        """One attempt: one call of helpers/ranks.py, which starts W&B afresh (a new process)."""
        ranks.run(
            resume_attempt,
            out,
            name,
            first,
            last,
            resumed,
            world_size=1,
            group=False,
            env=_env(tmp_path),
        )

    attempt("first", 1, 8, None)
    (first_id,) = set(_tagged(out / "stats" / "aggregate.jsonl"))
    attempt("second", 7, 9, 6)  # resumed from the step-6 checkpoint: 7 and 8 again
    by_id = _files_by_id(out)
    assert list(by_id) == [first_id] and len(by_id[first_id]) == 2, by_id
    files = by_id[first_id]
    assert _steps(files, "rank0/loss") == list(range(1, 10))
    assert _steps(files, "val/acc") == [8, 9]
    assert {wandb_records.run_info(f)["group"] for f in files} == {"test-group"}
    assert [wandb_records.exit_code(f) for f in files] == [0, 0]
    assert set(_tagged(out / "stats" / "aggregate.jsonl")) == {first_id}

    set_aside_stats(out)  # trainer.resume=never in the same dir: from step 0 again
    attempt("third", 1, 2, None)
    (third_id,) = set(_tagged(out / "stats" / "aggregate.jsonl"))
    assert third_id != first_id
    by_id = _files_by_id(out)
    assert set(by_id) == {first_id, third_id}
    assert _steps(by_id[third_id], "rank0/loss") == [1, 2]


def test_a_dir_whose_stats_name_no_run_resumes_the_run_wandb_ids_json_records(
    tmp_path: Path,
) -> None:
    """An output dir of an earlier version, which recorded its runs in wandb_ids.json and did
    not tag its stats rows: its job continues the recorded run; another project's record is
    not reopened."""
    out = tmp_path / "out"
    out.mkdir()
    entry = {"id": "0123456789abcdef", "project": "hydra-ddp-tests", "entity": None}
    (out / "wandb_ids.json").write_text(json.dumps({"runs": {"gather": entry}}))
    ranks.run(resume_attempt, out, "second", 1, 2, 1, world_size=1, group=False,
              env=_env(tmp_path))  # fmt: skip
    (record,) = _runs(out)
    assert wandb_records.run_info(record)["id"] == "0123456789abcdef"

    other = tmp_path / "other"
    other.mkdir()
    entry["project"] = "another-project"
    (other / "wandb_ids.json").write_text(json.dumps({"runs": {"gather": entry}}))
    ranks.run(resume_attempt, other, "third", 1, 2, None, world_size=1, group=False,
              env=_env(tmp_path))  # fmt: skip
    (record,) = _runs(other)
    assert wandb_records.run_info(record)["id"] != "0123456789abcdef"


# log_interval=1 and min_interval_s=0: every step is a W&B row, so a lost or repeated one shows.
_RESUME = (
    "trainer.progress=false",
    "trainer.log_interval=1",
    "trainer.ckpt_interval=3",
    "logger.min_interval_s=0",
)


def _job(tmp: Path, out: Path, *overrides: str) -> None:
    """The job's workers on 2 gloo ranks in process, W&B offline."""
    train_ranks(out, *_RESUME, *overrides, env=_env(tmp), timeout=300)


# group resumes a run per rank, the harder case; gather's one run is slow, for time.
@pytest.mark.parametrize("layout", [pytest.param("gather", marks=pytest.mark.slow), "group"])
def test_resumed_job_continues_its_wandb_runs(tmp_path: Path, layout: str) -> None:
    """2 ranks, offline: a job stopped after 6 steps and re-run in its dir up to 9
    logs into the same run(s) (one per rank for group): steps 1..9 once each, in order."""
    out = tmp_path / "job"
    _job(tmp_path, out, "trainer.max_steps=6", f"logger.layout={layout}")
    # The stats name each row's run: rank 0's rows its run, rank 1's its own (group).
    keys = ["rank0"] if layout == "gather" else ["rank0", "rank1"]
    recorded = {k: set(_tagged(out / "stats" / f"{k}.jsonl")) for k in keys}
    assert all(len(ids) == 1 for ids in recorded.values()), recorded
    _job(tmp_path, out, "trainer.max_steps=9", f"logger.layout={layout}")
    assert {k: set(_tagged(out / "stats" / f"{k}.jsonl")) for k in keys} == recorded
    assert not (out / "wandb_ids.json").exists()

    by_id = _files_by_id(out)
    assert sorted(by_id) == sorted(next(iter(ids)) for ids in recorded.values())
    train_key = "rank1/loss" if layout == "gather" else "train/loss"
    for key in keys:
        files = by_id[next(iter(recorded[key]))]
        assert len(files) == 2, files  # one offline-run-* dir per attempt, one run id
        assert _steps(files, train_key) == list(range(1, 10))
        infos = [wandb_records.run_info(f) for f in files]
        assert len({(i["name"], i["group"], i["job_type"]) for i in infos}) == 1, infos
        assert infos[1]["config"]["trainer"]["max_steps"] == 9  # the newest overrides
        assert [wandb_records.exit_code(f) for f in files] == [0, 0]
        if key == "rank0":
            assert _steps(files, "agg/loss_mean") == list(range(1, 10))
            assert _steps(files, "test/acc") == [6, 9]


@pytest.mark.slow
def test_resumed_from_an_older_checkpoint_skips_the_steps_wandb_has(tmp_path: Path) -> None:
    """Killed after logging step 8 but checkpointed at 6 (here: resumed from the step-6
    checkpoint on purpose): steps 7 and 8 are trained again but not sent again, on either
    rank's run, so W&B has every step once; the stats files hold every step once too, the
    first attempt's 7 and 8 moved to stats/superseded/ (which W&B's accounting still reads)."""
    out = tmp_path / "job"
    _job(tmp_path, out, "trainer.max_steps=8", "logger.layout=group")
    older = out / "checkpoints" / "step_00000006.pt"
    assert older.exists()
    _job(tmp_path, out, "trainer.max_steps=9", "logger.layout=group", f"trainer.resume={older}")
    by_id = _files_by_id(out)
    assert len(by_id) == 2 and all(len(files) == 2 for files in by_id.values()), by_id
    for files in by_id.values():
        assert _steps(files, "train/loss") == list(range(1, 10))
        assert _steps(files[1:], "train/loss") == [9]
    for name in ("rank0.jsonl", "rank1.jsonl", "aggregate.jsonl"):
        assert [r["step"] for r in _jsonl(out / "stats" / name)] == list(range(1, 10)), name
        superseded = _jsonl(out / "stats" / "superseded" / name)
        assert [r["step"] for r in superseded] == [7, 8], name


def _train_rank(env: DistEnv, cfg, run) -> dict:
    from helpers.inproc import train

    return train(cfg, env, run)


@pytest.mark.slow
def test_wandb_init_failing_on_rank_0_stops_every_rank_at_once(tmp_path: Path) -> None:
    """The gather layout starts W&B on rank 0 only: its failure reaches the other rank through
    one small collective, so both stop with W&B's reason instead of rank 1 waiting
    dist.timeout_s (300 s) for a rank that left."""
    env = wandb_env(
        tmp_path,
        WANDB_API_KEY=FAKE_KEY,
        WANDB_BASE_URL=f"http://127.0.0.1:{_closed_port()}",
        WANDB_INIT_TIMEOUT="3",
    )
    cfg, run = job(
        tmp_path / "job", "logger=wandb", "logger.mode=online", "logger.layout=gather",
        "trainer.progress=false", "trainer.max_steps=3", "dist.timeout_s=300",
    )  # fmt: skip
    t0 = time.monotonic()
    done = ranks.run(_train_rank, cfg, run, world_size=2, group=False, env=env,
                     return_exceptions=True, timeout=120)  # fmt: skip
    assert time.monotonic() - t0 < 60
    assert all(isinstance(d, UserError) for d in done), done
    assert "W&B could not be reached within 3 s" in str(done[0])
    assert str(done[1]).startswith("rank 0: W&B could not be reached"), done[1]


def test_a_wandb_timeout_is_unreachable_even_with_403_in_the_run_id() -> None:
    """W&B's own CommError for a server that timed out names the run id, which is hex: an id
    holding "403" must not read as the server refusing the run (seen in CI)."""
    import wandb

    from hydra_ddp.config import LoggerConfig
    from hydra_ddp.tracking.wandb_mode import init_error

    cfg = LoggerConfig(sink={"_target_": "hydra_ddp.tracking.wandb_sink.WandbSink"})
    timed_out = "Failed to get resume status for run 40379b8e21bb9fcd: context deadline exceeded"
    assert "could not be reached" in str(init_error(wandb.errors.CommError(timed_out), cfg, "on"))
    refused = "run 40379b8e21bb9fcd: 403 Forbidden"
    assert "refused the run" in str(init_error(wandb.errors.CommError(refused), cfg, "online"))


def test_a_resume_counts_only_its_own_runs_rows(tmp_path: Path) -> None:
    """Rows of an earlier W&B run in the same dir (before trainer.resume=never) do not count as
    sent: the resumed run re-sends from its own last row, not the earlier run's."""
    out = tmp_path / "job"
    offline = wandb_env(tmp_path, WANDB_MODE="offline")
    common = ["logger=wandb", "logger.mode=offline", "trainer.progress=false",
              "trainer.log_interval=1", "trainer.ckpt_interval=2"]  # fmt: skip
    for overrides in (["trainer.max_steps=8"], ["trainer.max_steps=4", "trainer.resume=never"],
                      ["trainer.max_steps=6"]):  # fmt: skip
        cfg, run = job(out, *common, *overrides)
        ranks.run(_train_rank, cfg, run, world_size=1, group=False, env=offline)
    rows = _jsonl(out / "stats" / "aggregate.jsonl")
    ids = [r["run"] for r in rows]
    assert len(set(ids)) == 1  # the second run (reopened by the resume) alone
    # trainer.resume=never set the first run's stats and summary aside with its checkpoints.
    first = _jsonl(out / "stats.before-1" / "aggregate.jsonl")
    assert [r["step"] for r in first] == list(range(1, 9))
    assert {r["run"] for r in first} != set(ids)
    assert json.loads((out / "stats.before-1" / "job_summary.json").read_text())["steps"] == 8
    # The second run got steps 1-4, then 5-6 after its resume: nothing skipped for the first
    # run's steps 5-8.
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6], rows
    # trainer.resume=never set the first run's checkpoints aside instead of mixing them in.
    assert sorted(p.name for p in (out / "checkpoints.before-1").glob("step_*")) == [
        "step_00000006.pt", "step_00000008.pt",
    ]  # fmt: skip
    (newest,) = [
        p for p in sorted(out.glob("wandb/offline-run-*/run-*.wandb"))
        if ids[-1] in p.name
    ][-1:]  # fmt: skip
    sent = [
        r[STEP] for r in wandb_records.history_rows(newest) if STEP in r and "agg/loss_mean" in r
    ]
    assert sent == [5, 6], sent


def test_wandb_gpu_ids_follow_cuda_visible_devices(monkeypatch) -> None:
    """W&B's system monitor sees every GPU of the machine: cuda:0 of a task that sees GPUs 2,3
    is GPU 2 there."""
    from hydra_ddp.tracking.wandb_sink import physical_gpu

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert (physical_gpu(0), physical_gpu(1)) == (2, 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-3f2a")  # UUIDs: the ordinal is all we have
    assert physical_gpu(0) == 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert physical_gpu(1) == 1


@pytest.mark.parametrize("layout", ["gather", pytest.param("group", marks=pytest.mark.slow)])
def test_every_ranks_ctx_log_and_every_groups_lr_reach_wandb(tmp_path: Path, layout: str) -> None:
    """ctx.log on both ranks at every step: under gather rank 1's values reach rank 0's run as
    rank1/<key> (at the next log interval, the last ones at the end), under group its own run;
    every parameter group's learning rate is a key of its own."""
    out = tmp_path / "job"
    _job(
        tmp_path, out, "trainer.max_steps=5", "trainer.log_interval=2", f"logger.layout={layout}",
        "+callbacks.log._target_=helpers.user_log_callbacks.LogEveryRank",
        "+optim.param_groups=[{params: 'net.0.*', lr: 0.01}]",
    )  # fmt: skip
    runs = {wandb_records.run_info(p)["job_type"]: p for p in _runs(out)}
    rows = {key: wandb_records.history_rows(path) for key, path in runs.items()}
    for rank in (0, 1):
        if layout == "gather":
            mine, key, lr = rows[""], f"rank{rank}/rank_step", f"rank{rank}/lr/default/0"
        else:
            mine, key, lr = rows[f"rank{rank}"], "train/rank_step", "train/lr/default/0"
        logged = sorted((r[STEP], r[key]) for r in mine if key in r)
        assert logged == [(s, 100 * rank + s) for s in range(1, 6)], (key, logged)
        notes = [r for r in mine if key.replace("rank_step", "note/_type") in r]  # text: HTML
        assert len(notes) == 5 and all(r[key.replace("rank_step", "half")] == 0.5 for r in notes)
        assert _steps([runs[""] if layout == "gather" else runs[f"rank{rank}"]], lr) == [2, 4, 5]
        stats = [r for r in _jsonl(out / "stats" / f"rank{rank}.jsonl") if "loss" in r]
        assert all({"lr/default/0", "lr/default/rest"} <= r.keys() for r in stats)


def test_a_resume_writes_no_step_twice_and_resume_never_sets_the_stats_aside(
    tmp_path: Path,
) -> None:
    """Run to 10 (checkpoints at 5 and 10), lose the step-10 checkpoint, resume to 12: steps
    6..10 appear once in each rank's file, the aggregate and eval.jsonl (the first attempt's
    rows past step 5 are in stats/superseded/). Then trainer.resume=never in that dir moves the
    stats and summary aside, as it does the checkpoints."""
    out = tmp_path / "job"
    every = ["logger=none", "trainer.ckpt_interval=5", "trainer.eval_interval=2"]
    _job(tmp_path, out, *every, "trainer.max_steps=10")
    (out / "checkpoints" / "step_00000010.pt").unlink()
    _job(tmp_path, out, *every, "trainer.max_steps=12")
    stats = out / "stats"
    for name in ("rank0.jsonl", "rank1.jsonl", "aggregate.jsonl"):
        steps = [r["step"] for r in _jsonl(stats / name)]
        assert steps == list(range(1, 13)), (name, steps)
        assert [r["step"] for r in _jsonl(stats / "superseded" / name)] == [6, 7, 8, 9, 10]
    evals = [r["step"] for r in _jsonl(stats / "eval.jsonl")]
    assert evals == sorted(set(evals)) and evals[-1] == 12 and 6 in evals, evals
    assert json.loads((out / "summary.json").read_text())["steps"] == 12

    _job(tmp_path, out, *every, "trainer.max_steps=3", "trainer.resume=never")
    aside = out / "stats.before-1"
    assert [r["step"] for r in _jsonl(aside / "rank1.jsonl")] == list(range(1, 13))
    assert json.loads((aside / "job_summary.json").read_text())["steps"] == 12
    assert [r["step"] for r in _jsonl(stats / "rank1.jsonl")] == [1, 2, 3]
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
