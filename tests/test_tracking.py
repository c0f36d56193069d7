"""hydra_ddp.tracking end to end: real torchrun (gloo, 2 ranks), real offline W&B runs.

Every W&B setting the tests need goes into the subprocess environment only; W&B's config,
cache and netrc are pointed into tmp_path so nothing on this machine (a real login included)
changes the outcome, and W&B never goes online.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import wandb_records  # noqa: E402  (a test helper next to this file)
from conftest import user_env  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "_tracking_worker.py"
PLOT = REPO / "scripts" / "plot_run.py"
FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"  # 40 hex chars, the shape of a real key
STEPS = 5
SHARED_MSG = "logger.layout=shared needs W&B online ("
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _env(tmp: Path, **extra: Optional[str]) -> dict[str, str]:
    """A subprocess environment with W&B isolated under ``tmp`` and forced offline."""
    return user_env(
        tmp,
        **{"WANDB_MODE": "offline", "WANDB_ARTIFACT_DIR": str(tmp / "wandb-artifacts"), **extra},
    )


def _torchrun(
    tmp: Path,
    out: Path,
    *args: str,
    env: Optional[dict[str, str]] = None,
) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(WORKER),
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        *args,
    ]
    return subprocess.run(
        cmd, cwd=tmp, env=env or _env(tmp), capture_output=True, text=True, timeout=120
    )


def _ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"


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
    _ok(_torchrun(tmp, out, "--layout", "gather"))
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
    _ok(_torchrun(tmp_path, out, "--layout", "gather", "--min-interval", "3600"))
    runs = _runs(out)
    assert len(runs) == 1, runs
    rows = wandb_records.history_rows(runs[0])
    train = [r for r in rows if "rank0/loss" in r]
    assert [r["trainer/step"] for r in train] == [1, STEPS]
    assert train[-1]["rank1/step_time"] == pytest.approx(0.10 + 0.05 + 0.001 * STEPS)
    assert train[-1]["agg/slowest_rank"] == 1
    assert [r["trainer/step"] for r in rows if "val/acc" in r] == [STEPS]
    _check_rank_files(out)


def test_plot_run_draws_per_rank_pngs(gather_run: Path, tmp_path: Path) -> None:
    plots = tmp_path / "plots"
    proc = subprocess.run(
        [sys.executable, str(PLOT), str(gather_run), "--out", str(plots)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    _ok(proc)
    for stat in ("loss", "step_time", "data_wait", "rss_mb", "samples_per_s"):
        data = (plots / f"{stat}.png").read_bytes()
        assert data.startswith(PNG_MAGIC) and data[12:16] == b"IHDR" and len(data) > 5000
    # cuda_mem_mb is all zero on CPU, so there is nothing to show.
    assert not (plots / "cuda_mem_mb.png").exists()


def test_plot_run_without_stats_exits_2(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(PLOT), str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "no stats files found" in proc.stderr


def test_group_layout_one_run_per_rank(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _ok(_torchrun(tmp_path, out, "--layout", "group"))
    infos = {}
    for path in _runs(out):
        info = wandb_records.run_info(path)
        infos[info["job_type"]] = (info, wandb_records.history_rows(path), path)
    assert sorted(infos) == ["rank0", "rank1"]
    groups = {info["group"] for info, _, _ in infos.values()}
    assert groups == {"test-group-train"}
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
    proc = _torchrun(
        tmp_path, out, "--layout", "shared", "--mode", "auto", env=_env(tmp_path, WANDB_MODE=None)
    )
    assert proc.returncode != 0
    for rank in (0, 1):
        code, message = (out / f"exit-rank{rank}.txt").read_text().splitlines()
        assert code == "2" and message.startswith(SHARED_MSG)
        assert "use logger.layout=gather or group, or log in" in message
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and all(SHARED_MSG in e for e in errors)
    assert "exitcode  : 2" in proc.stderr  # torchrun saw a clean exit 2, not a kill
    assert not (out / "wandb").exists() and not _runs(out)


def test_backend_none_writes_jsonl_only(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _ok(_torchrun(tmp_path, out, "--backend", "none"))
    _check_rank_files(out)
    assert not any(p.name == "wandb" for p in tmp_path.rglob("*")), "a wandb dir was created"
    for rank in (0, 1):
        result = json.loads((out / f"result-rank{rank}.json").read_text())
        assert result == {"wandb_imported": False}


def test_sequential_trackers_in_one_process(tmp_path: Path) -> None:
    # Hydra's basic launcher runs a sweep's jobs one after another in one process.
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(WORKER),
            "--out",
            str(out),
            "--scenario",
            "sequential",
            "--steps",
            str(STEPS),
        ],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    _ok(proc)
    ids = []
    for job, want_exit in (("job0", 0), ("job1", 1)):
        runs = _runs(out / job)
        assert len(runs) == 1, runs
        info = wandb_records.run_info(runs[0])
        assert info["name"] == job
        assert wandb_records.exit_code(runs[0]) == want_exit  # finished, failed one marked
        assert len([r for r in wandb_records.history_rows(runs[0]) if "rank0/loss" in r]) == STEPS
        ids.append(info["id"])
    assert ids[0] != ids[1]


def test_api_key_never_lands_in_output_dir(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # group layout: both ranks write a run; --leak-key also puts the key into the config.
    proc = _torchrun(
        tmp_path, out, "--layout", "group", "--leak-key", env=_env(tmp_path, WANDB_API_KEY=FAKE_KEY)
    )
    _ok(proc)
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(_runs(out)) == 2 and len(files) > 10
    leaked = [p for p in files if FAKE_KEY.encode() in p.read_bytes()]
    assert not leaked, leaked
    assert FAKE_KEY not in proc.stdout + proc.stderr
    config = wandb_records.run_info(_runs(out)[0])["config"]
    assert config["logger"] == {"api_key": "<redacted>"}
    assert config["note"] == "run with key <redacted>"


_RESOLVE = """
import json, os
from hydra_ddp.config import WandbMode
from hydra_ddp.tracking import resolve_mode
print(json.dumps({m: resolve_mode(WandbMode(m))[0] for m in ("auto", "offline", "online")}))
"""


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
def test_auto_mode_resolution(tmp_path: Path, setup: str, auto: str) -> None:
    netrc = tmp_path / "netrc"
    extra: dict[str, Optional[str]] = {"WANDB_MODE": None, "NETRC": str(netrc)}
    if setup == "api_key":
        extra["WANDB_API_KEY"] = FAKE_KEY
    elif setup == "netrc":
        netrc.write_text(f"machine api.wandb.ai\n  login user\n  password {FAKE_KEY}\n")
    elif setup == "netrc_other_host":
        netrc.write_text(f"machine example.com\n  login user\n  password {FAKE_KEY}\n")
    elif setup == "wandb_mode":
        extra.update(WANDB_MODE="offline", WANDB_API_KEY=FAKE_KEY)
    if netrc.exists():
        netrc.chmod(0o600)
    proc = subprocess.run(
        [sys.executable, "-c", _RESOLVE],
        env=_env(tmp_path, **extra),
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    _ok(proc)
    modes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert modes == {"auto": auto, "offline": "offline", "online": "online"}
    assert FAKE_KEY not in proc.stdout + proc.stderr
