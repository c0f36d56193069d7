"""W&B for a logged-in user's concerns, checked offline: a secret given on the command line
leaves no trace in the W&B run, the logs or the console (one real CLI run);
a run stopped by SIGTERM finishes with a non-zero exit code; fresh runs in a dir re-created at
the same path get new ids."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from conftest import ok, run, user_env
from helpers import ranks, wandb_records
from helpers.inproc import job

SECRET = "tok_" + "5ecret" * 4  # built here: not a literal in any file a run might copy


def _runs(out: Path) -> list[Path]:
    return sorted(out.glob("wandb/offline-run-*/run-*.wandb"))


@pytest.mark.slow  # a real launch; the default suite keeps to 5 minutes
def test_a_secret_on_the_command_line_reaches_no_file_log_or_console(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "hydra_ddp.train", "model._target_=helpers.user_callbacks.TokenMLP",
        "~model.hidden", "~model.depth", "~model.dropout", f"+model.api_token={SECRET}",
        "logger.mode=offline", "trainer.max_steps=3", f"hydra.run.dir={out}",
    ]  # fmt: skip
    proc = ok(run(cmd, tmp_path, env=user_env(tmp_path, PYTHONPATH=_with_tests())))
    assert SECRET not in proc.stdout + proc.stderr  # the console, config tree included
    leaked = [
        p for p in out.rglob("*")
        if p.is_file() and ".hydra" not in p.parts and SECRET.encode() in p.read_bytes()
    ]  # fmt: skip
    assert not leaked, leaked  # wandb/ (config, metadata, args), logs, run.json
    assert SECRET in (out / ".hydra" / "config.yaml").read_text()  # the job's own record keeps it
    (record,) = _runs(out)
    config = wandb_records.run_info(record)["config"]
    assert config["model"]["api_token"] == "<redacted>"
    assert config["model"]["_target_"] == "helpers.user_callbacks.TokenMLP"  # the rest is untouched
    # The command line W&B records (the run's args, inside the record) is the redacted one.
    assert b"+model.api_token=<redacted>" in record.read_bytes()


def _with_tests() -> str:
    import os

    tests = str(Path(__file__).resolve().parent)
    return os.pathsep.join([tests, user_env(Path("/tmp"))["PYTHONPATH"]])


def _train(env, cfg, run_info):
    from helpers.inproc import train

    return train(cfg, env, run_info)


@pytest.mark.slow
def test_a_sigterm_stopped_run_finishes_non_zero_and_fresh_ids_are_new(tmp_path: Path) -> None:
    out = tmp_path / "run"
    wandb_env = {"WANDB_MODE": "offline", "WANDB_DIR": None}
    stop_at_3 = [
        "+callbacks.stop._target_=helpers.user_callbacks.SignalAt",
        "+callbacks.stop.at=3",
    ]
    cfg, info = job(out, "logger.mode=offline", "trainer.progress=false", *stop_at_3)
    done = ranks.run(_train, cfg, info, world_size=1, group=False, env=wandb_env,
                     return_exceptions=True)  # fmt: skip
    assert "stopped on SIGTERM at step" in str(done[0]), done[0]
    (record,) = _runs(out)
    assert wandb_records.exit_code(record) == 128 + 15
    first_id = wandb_records.run_info(record)["id"]

    shutil.rmtree(out)  # the same path, a new run
    cfg, info = job(out, "logger.mode=offline", "trainer.progress=false", "trainer.max_steps=2")
    ranks.run(_train, cfg, info, world_size=1, group=False, env=wandb_env)
    (record,) = _runs(out)
    assert wandb_records.run_info(record)["id"] != first_id
    assert wandb_records.exit_code(record) == 0
