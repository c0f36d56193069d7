"""The ends of jobs: whatever the last step is (a checkpoint step or not, a validation step, an
early stop), with the periodic saves in the background or not, and whether the last
validation improved the best or not, under DDP and under fsdp2, a job ends with its
summary.json, its last checkpoint at its last step and its best checkpoint at the best step,
both loadable, and nothing half-written left in checkpoints/.

The jobs are the text GPT's (experiment=text_gpt, shrunk), with its SampleText callback, which
runs a forward of the model after each validation: under fsdp2 a forward on rank 0 alone paired
with the next save's gather on rank 1 (a gloo abort at the end of the job). On real gloo ranks
in process (helpers/ranks.py); one real torchrun launch of the job that aborted (slow).

Also: best.dcp is replaced by a swap of two renames; a kill between them leaves the new and
the old best whole, and evaluation and the next save resolve to a whole best.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import FAST, ok, summary, torchrun
from helpers.inproc import compose, isolated, train_ranks
from helpers.runs import assert_close
from omegaconf import OmegaConf

from hydra_ddp import checkpoint
from hydra_ddp.eval import main as evaluate_main

GPT = [
    *FAST,
    "experiment=text_gpt",
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "data.block_size=16",
    "trainer.batch_size=8",
    "scheduler.warmup_steps=1",
    "trainer.limit_eval_batches=2",
    "trainer.eval_interval=2",
    "trainer.keep_ckpts=5",
    "callbacks.sample_text.length=3",
]
# Validation loss falls over these first steps, so monitor_mode=max keeps the first validation
# as the best and each later one is "not improved" (early stop with patience 1 at the second).
NOT_IMPROVED = ["trainer.monitor_mode=max"]
EARLY_STOP = [*NOT_IMPROVED, "trainer.max_steps=10", "trainer.early_stop_patience=1"]

# id: (overrides, the steps of the step checkpoints, the best step, the validation steps)
CASES = {
    "last_step_on_ckpt_and_eval_step": (
        ["trainer.max_steps=4", "trainer.ckpt_interval=2"], [2, 4], 4, [2, 4]),
    "last_step_off_ckpt_and_eval_step": (
        ["trainer.max_steps=5", "trainer.ckpt_interval=2"], [2, 4, 5], 5, [2, 4, 5]),
    "best_not_improved_at_the_end": (
        ["trainer.max_steps=4", "trainer.ckpt_interval=2", *NOT_IMPROVED], [2, 4], 2, [2, 4]),
    "early_stop_on_ckpt_step": ([*EARLY_STOP, "trainer.ckpt_interval=2"], [2, 4], 2, [2, 4]),
    "early_stop_off_ckpt_step": ([*EARLY_STOP, "trainer.ckpt_interval=3"], [3, 4], 2, [2, 4]),
    "no_periodic_ckpt_or_eval": (
        ["trainer.max_steps=3", "trainer.ckpt_interval=0", "trainer.eval_interval=0"],
        [3], 3, [3]),
}  # fmt: skip
WRAPPERS = {
    "default": ["ddp=default"],
    "fsdp2": ["ddp=fsdp2"],
    "async": ["ddp=fsdp2", "trainer.async_ckpt=true"],  # the periodic saves in the background
}
ASYNC_CASES = [c for c in CASES if c.startswith(("last_step", "early_stop"))]
# The default suite: the failing job's shape under both wrappers, and the background saves
# meeting an early stop (~7 s on 2 busy cores); the rest of the matrix is slow.
FAST_CASES = {
    ("default", "last_step_on_ckpt_and_eval_step"),
    ("fsdp2", "last_step_on_ckpt_and_eval_step"),
    ("async", "early_stop_on_ckpt_step"),
}


def _params() -> list:
    return [
        pytest.param(
            wrapper,
            case,
            id=f"{wrapper}-{case}",
            marks=() if (wrapper, case) in FAST_CASES else pytest.mark.slow,
        )
        for wrapper in WRAPPERS
        for case in (ASYNC_CASES if wrapper == "async" else CASES)
    ]


def check_end(job: Path, fsdp2: bool, steps: list[int], best_step: int, stopped: bool) -> None:
    """summary.json, the last and the best checkpoint (loadable, at their steps), no leftovers."""
    done = summary(job)
    assert done["steps"] == steps[-1] and done["best_step"] == best_step, done
    assert done["stopped_early"] is stopped
    folder = checkpoint.checkpoint_dir(job)
    suffix = ".dcp" if fsdp2 else ".pt"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [f"best{suffix}", *(f"step_{s:08d}{suffix}" for s in steps)]
    )  # nothing half-written (.tmp, .old) is left
    last = checkpoint.latest(job)
    assert last == folder / f"step_{steps[-1]:08d}{suffix}"
    assert checkpoint.load(last)["step"] == steps[-1]
    best = checkpoint.best(job)
    assert best == folder / f"best{suffix}"
    weights = checkpoint.load(best)
    assert weights["step"] == best_step
    if best_step in steps:  # the best is that step's checkpoint
        step_ckpt = checkpoint.load(folder / f"step_{best_step:08d}{suffix}")
        assert_close(weights["model"], step_ckpt["model"], atol=0)


@pytest.mark.parametrize(("wrapper", "case"), _params())
def test_a_job_ends_with_its_summary_last_and_best_checkpoints(
    tmp_path: Path, wrapper: str, case: str
) -> None:
    overrides, steps, best_step, validations = CASES[case]
    stopped = case.startswith("early_stop")
    results = train_ranks(tmp_path, *GPT, *WRAPPERS[wrapper], *overrides, timeout=180)
    assert results[0]["steps"] == results[1]["steps"] == steps[-1]  # every rank's summary
    check_end(tmp_path, wrapper != "default", steps, best_step, stopped)
    # The text GPT's sample after each validation (its forwards on every rank), rank 0's logged.
    samples = [ln for ln in results.logs[0].splitlines() if "sample at step" in ln]
    assert [int(ln.rsplit(" ", 1)[1].rstrip(":")) for ln in samples] == validations
    assert "sample at step" not in results.logs[1]


@pytest.mark.slow  # a real torchrun launch of the text GPT under fsdp2
def test_torchrun_fsdp2_text_gpt_ending_on_a_checkpoint_step_exits_0(tmp_path: Path) -> None:
    """The job that aborted at its end (rank 1 SIGABRT in gloo inside the final save's
    gather, exit 1, no summary.json): the experiment's model, 20 steps, a checkpoint every
    10. The cause was not the checkpoint step: the sample callback's forwards ran on rank 0
    alone (also with trainer.ckpt_interval=0)."""
    proc = ok(torchrun(tmp_path, "experiment=text_gpt", "ddp=fsdp2", "logger=none",
                       "trainer.max_steps=20", "trainer.ckpt_interval=10",
                       "trainer.limit_eval_batches=4", "hydra.run.dir=job",
                       timeout=600))  # fmt: skip
    assert "SIGABRT" not in proc.stderr and "EnforceNotMet" not in proc.stderr
    check_end(tmp_path / "job", True, [10, 20], summary(tmp_path / "job")["best_step"], False)
    assert summary(tmp_path / "job")["best_step"] == 20
    assert "sample at step 20" in (tmp_path / "job" / "train_rank0.log").read_text()


# --------------------------------------------------------------------------------------------
# best.dcp: replaced by a swap a kill cannot lose
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "old_left",
    [True, False],
    ids=["old_best_left", "old_best_deleted"],
)
@pytest.mark.slow
def test_a_kill_inside_the_best_swap_loses_no_best(tmp_path: Path, old_left: bool) -> None:
    """A kill while best.dcp is being replaced (the old folder moved aside, or already deleted,
    the new one whole under its temporary name): `hydra_ddp.eval ckpt=best` evaluates the new
    best, and the resumed job's next save puts it back as best.dcp."""
    job = [*GPT, "ddp=fsdp2", "trainer.ckpt_interval=2"]
    train_ranks(tmp_path, *job, "trainer.max_steps=4")
    assert summary(tmp_path)["best_step"] == 4
    folder = checkpoint.checkpoint_dir(tmp_path)
    # The kill's window: step 2's best moved out, step 4's whole and about to be renamed in.
    (folder / "best.dcp").rename(folder / ".best.dcp.tmp")
    if old_left:
        shutil.copytree(folder / "step_00000002.dcp", folder / ".best.dcp.old")
    assert checkpoint.best(tmp_path) == folder / ".best.dcp.tmp"
    # Beside it, a step's save killed after its manifest, before its rename: never named, so
    # not a swap's leftover, and cleared as before.
    shutil.copytree(folder / "step_00000004.dcp", folder / ".step_00000006.dcp.tmp")
    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(compose(*job, "trainer.max_steps=4"), tmp_path / ".hydra" / "config.yaml")
    with isolated():
        evaluate_main([f"run={tmp_path}", "ckpt=best", "split=val"])  # SystemExit: a failure
    assert json.loads((tmp_path / "eval_val.json").read_text())["step"] == 4
    # The resumed job's next save (step 5's, on a SIGTERM) clears the leftovers and puts the
    # best back under its name.
    stop = ["+callbacks.stop._target_=helpers.user_callbacks.SignalAt", "+callbacks.stop.at=5"]
    stopped = train_ranks(tmp_path, *job, "trainer.max_steps=10", *stop, return_exceptions=True)
    assert "stopped on SIGTERM at step 5" in str(stopped[0]), stopped[0]
    assert sorted(p.name for p in folder.iterdir()) == [
        "best.dcp", "step_00000002.dcp", "step_00000004.dcp", "step_00000005.dcp"
    ]  # fmt: skip
    assert checkpoint.best(tmp_path) == folder / "best.dcp"
    assert checkpoint.load(folder / "best.dcp")["step"] == 4
