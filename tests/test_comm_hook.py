"""PowerSGD's state in the checkpoint, on two gloo ranks: its step count and each rank's error
feedback are saved, and restored into a fresh hook as they were (so a resume neither repeats
the plain all-reduce warm-up nor drops the error feedback). ddp.powersgd_start_iter=1, which
PowerSGD itself refuses, is refused when the config is composed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import FAST
from helpers.inproc import job, prepare_job, train_ranks, typed

from hydra_ddp import checkpoint
from hydra_ddp.checkpoint.checkpointer import to_cpu
from hydra_ddp.errors import UserError

POWERSGD = [*FAST, "ddp=powersgd", "ddp.powersgd_start_iter=2", "ddp.powersgd_rank=1"]


def _restore_hook(env, cfg, run, path: str) -> dict:
    """A rank: a fresh DDP wrap with the PowerSGD hook, restored from `path`; its state."""
    from hydra_ddp.checkpoint import Checkpointer, state
    from hydra_ddp.distributed.ddp import wrap_model

    job_ = prepare_job(cfg, env, run)
    _, hook = wrap_model(job_.components.model, env, cfg.ddp)
    before = hook.state_dict()["iter"]
    objects = state.CheckpointedObjects(model=job_.components.model, comm_hook=hook)
    Checkpointer(run.output_dir, env, objects).restore(Path(path))
    return {"before": before, **to_cpu(hook.state_dict())}


@pytest.mark.slow
def test_powersgd_state_survives_a_resume(tmp_path: Path) -> None:
    from helpers import ranks

    summaries = train_ranks(tmp_path, *POWERSGD, "trainer.max_steps=6")
    path = checkpoint.latest(tmp_path)
    saved = checkpoint.load(path)["rng"]
    for rank in (0, 1):
        hook = saved[rank]["comm_hook"]
        assert hook["iter"] == 6 and hook["error_dict"], "error feedback is saved per rank"
    # The memory plan counts that state (memory.powersgd_bytes): what it keeps between
    # steps (the error feedback, the factors P and Q) and, while it runs on the one bucket of
    # this small model, two more bucket-sized tensors; no CUDA workspaces on a CPU job.
    kept = {k: sum(t.numel() * t.element_size() for t in hook[k].values())
            for k in ("error_dict", "p_memory_dict", "q_memory_dict")}  # fmt: skip
    planned = summaries[0]["memory_plan"]
    assert kept["p_memory_dict"] and kept["q_memory_dict"]
    assert planned["hook_state"] == sum(kept.values()) + 2 * kept["error_dict"]
    assert planned["workspaces"] == 0
    assert not torch.equal(
        next(iter(saved[0]["comm_hook"]["error_dict"].values())),
        next(iter(saved[1]["comm_hook"]["error_dict"].values())),
    ), "each rank's own error feedback, not rank 0's twice"

    cfg, run = job(tmp_path, *POWERSGD, "trainer.max_steps=6")
    restored = ranks.run(_restore_hook, cfg, run, str(path))
    for rank in (0, 1):
        assert restored[rank]["before"] == 0 and restored[rank]["iter"] == 6
        for key, tensor in saved[rank]["comm_hook"]["error_dict"].items():
            torch.testing.assert_close(restored[rank]["error_dict"][key], tensor)

    # And the real resume continues from there.
    summaries = train_ranks(tmp_path, *POWERSGD, "trainer.max_steps=8")
    assert summaries[0]["steps"] == 8 and summaries[0]["steps_this_run"] == 2
    assert checkpoint.load(checkpoint.latest(tmp_path))["rng"][1]["comm_hook"]["iter"] == 8


def test_powersgd_start_iter_below_two_is_refused_at_compose() -> None:
    with pytest.raises(UserError, match=r"ddp\.powersgd_start_iter=1 is not allowed: .* >= 2"):
        typed("ddp=powersgd", "ddp.powersgd_start_iter=1")


def test_a_comm_hook_name_that_is_not_built_in_is_refused_at_compose() -> None:
    with pytest.raises(
        UserError, match=r"ddp\.comm_hook='fp8' is not allowed: .*powersgd.*_target_"
    ):
        typed("ddp.comm_hook=fp8")


def test_a_comm_hook_target_without_a_hook_is_refused_in_one_line() -> None:
    from hydra_ddp.distributed import comm_hooks

    with pytest.raises(UserError, match=r"^ddp\.comm_hook\._target_=collections\.Counter built a "
                       r"Counter without hook\(state, bucket\)") as e:  # fmt: skip
        comm_hooks.build_comm_hook({"_target_": "collections.Counter"}, 2, 10, "cpu")
    assert "\n" not in str(e.value)
    with pytest.raises(
        UserError, match=r"ddp\.comm_hook \(.*PowerSGD\): ddp\.comm_hook\.start_iter"
    ):
        comm_hooks.build_comm_hook(
            {"_target_": "hydra_ddp.distributed.comm_hooks.PowerSGD", "rank": 1, "start_iter": 1},
            2,
            10,
            "cpu",
        )


def test_a_bad_comm_hook_of_the_users_fails_once_in_the_launching_process() -> None:
    """launch/runner.py's preflight builds the hook before any worker starts: one line, not
    one per rank."""
    from hydra_ddp.launch.runner import preflight

    cfg = typed("ddp.comm_hook={_target_:collections.Counter}")
    with pytest.raises(UserError, match=r"^ddp\.comm_hook\._target_=collections\.Counter built"):
        preflight(cfg, world_size=2)
    preflight(typed("ddp=powersgd", "ddp.powersgd_start_iter=2"), world_size=2)


def test_a_one_process_run_checks_the_hook_it_does_not_use(tmp_path: Path) -> None:
    """One process trains unwrapped, so a typo'd hook passed unseen until the first run on
    several ranks: it is refused where it is typed, in one line."""
    import subprocess
    import sys

    from conftest import user_env

    run = f"hydra.run.dir={tmp_path / 'run'}"
    cmd = [sys.executable, "-m", "hydra_ddp.train", *FAST, "trainer.max_steps=1",
           "ddp.comm_hook={_target_:nowhere.Hook}", run]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, env=user_env(tmp_path), capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in (done.stdout + done.stderr).splitlines() if "error: " in line]
    assert len(errors) == 1 and "ddp.comm_hook._target_='nowhere.Hook' cannot be" in errors[0]
    assert not (tmp_path / "run" / "checkpoints").exists()
