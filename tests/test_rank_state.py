"""State that differs between ranks, through the real loop on two gloo ranks (helpers/ranks.py),
the same job under DDP and under ddp=fsdp2:

* a gradient norm a callback logs (README's per-layer recipe) is the whole gradient's under
  fsdp2 too (a DTensor given to ctx.log is logged whole), and the same as DDP's;
* BatchNorm's running statistics, which each rank updates from its own batches: the run's
  final val metrics equal an evaluation of its checkpoint, and the checkpoint holds rank 0's,
  which every rank has at the end;
* a callback's state comes back to the rank that saved it after a resume (and a checkpoint
  from when it was saved from rank 0 alone gives that state to every rank).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import FAST
from helpers.inproc import compose, isolated, train_here, train_ranks
from omegaconf import OmegaConf

from hydra_ddp import checkpoint
from hydra_ddp.errors import UserError
from hydra_ddp.eval import main as evaluate_main

JOB = [
    *FAST, "model._target_=helpers.rank_state.BatchNormMLP", "model.hidden=32",
    "trainer.max_steps=3", "trainer.eval_interval=0", "trainer.log_interval=1",
    "+callbacks.grads._target_=helpers.user_hooks.LayerGradNorms",
    "+callbacks.mine._target_=helpers.rank_state.PerRank",
    "+callbacks.whole._target_=helpers.rank_state.WholeOnRankZero",
]  # fmt: skip
WRAPPERS = {"ddp": [], "fsdp2": ["ddp=fsdp2"]}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The BatchNorm job for 3 steps on 2 ranks under each wrapper."""
    root = tmp_path_factory.mktemp("rank_state")
    for wrapper, extra in WRAPPERS.items():
        train_ranks(root / wrapper, *JOB, *extra)
    return {wrapper: root / wrapper for wrapper in WRAPPERS}


def _read(job: Path, name: str, rank: int) -> dict | None:
    return json.loads((job / f"{name}_rank{rank}.json").read_text())


def _grad_norms(job: Path, rank: int, prefix: str = "grad/") -> dict[int, dict[str, float]]:
    rows = map(json.loads, (job / "stats" / f"rank{rank}.jsonl").read_text().splitlines())
    norms: dict[int, dict[str, float]] = {}
    for row in rows:
        norms.setdefault(row.get("step"), {}).update(
            {k[len(prefix) :]: v for k, v in row.items() if k.startswith(prefix)}
        )
    return {step: found for step, found in norms.items() if found}


def test_a_logged_gradient_norm_is_the_whole_gradients_under_fsdp2(pair: dict[str, Path]) -> None:
    ddp = _grad_norms(pair["ddp"], 0)
    assert sorted(ddp) == [1, 2, 3] and len(ddp[1]) == 6  # 2 linear, 1 BatchNorm: w and b
    for rank in (0, 1):
        fsdp2, same = _grad_norms(pair["fsdp2"], rank), _grad_norms(pair["ddp"], rank)
        assert sorted(fsdp2) == sorted(same) == [1, 2, 3]
        for step in ddp:  # not each rank's shard's norm (a bias's is ~1e-7: BatchNorm follows)
            assert same[step] == pytest.approx(ddp[step], rel=1e-6, abs=1e-6)
            assert fsdp2[step] == pytest.approx(ddp[step], rel=1e-4, abs=1e-6), (rank, step)
    # The docs' recipe: full_tensor() on every rank, logged on rank 0 only.
    whole = _grad_norms(pair["fsdp2"], 0, "whole/")
    assert sorted(whole) == [1, 2, 3]
    for step in ddp:
        assert whole[step] == pytest.approx(ddp[step], rel=1e-4, abs=1e-6), step
    assert _grad_norms(pair["fsdp2"], 1, "whole/") == {}


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_batchnorm_statistics_are_rank_0s_in_evaluation_and_checkpoint(
    pair: dict[str, Path], wrapper: str
) -> None:
    job = pair[wrapper]
    summary = json.loads((job / "stats" / "summary.json").read_text())
    # What `python -m hydra_ddp.eval run=<job> split=val` reports (its main, in process).
    (job / ".hydra").mkdir(exist_ok=True)
    OmegaConf.save(compose(*JOB, *WRAPPERS[wrapper]), job / ".hydra" / "config.yaml")
    with isolated():
        evaluate_main([f"run={job}", "split=val"])
    evaluated = json.loads((job / "eval_val.json").read_text())
    assert evaluated["step"] == 3
    assert evaluated["loss"] == pytest.approx(summary["val_loss"], rel=1e-6)
    assert evaluated["acc"] == pytest.approx(summary["val_acc"], rel=1e-9)
    # Every rank ended with rank 0's statistics, which the checkpoint holds.
    ranks = [torch.load(job / f"buffers_rank{r}.pt", weights_only=True) for r in (0, 1)]
    saved = checkpoint.load(checkpoint.latest(job))["model"]
    for name in ("net.1.running_mean", "net.1.running_var", "net.1.num_batches_tracked"):
        assert torch.equal(ranks[1][name], ranks[0][name]), name
        assert torch.equal(saved[name].cpu(), ranks[0][name]), name
    assert int(saved["net.1.num_batches_tracked"]) == 3


def test_each_rank_resumes_its_own_callback_state(pair: dict[str, Path], tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(pair["ddp"], run)
    saved = [_read(run, "saved", rank) for rank in (0, 1)]
    assert [s["rank"] for s in saved] == [0, 1] and saved[0]["loss_sum"] != saved[1]["loss_sum"]
    assert [_read(run, "loaded", rank) for rank in (0, 1)] == [None, None]
    train_ranks(run, *JOB, "trainer.max_steps=4")  # resumed at step 3
    assert [_read(run, "loaded", rank) for rank in (0, 1)] == saved
    # The layout before: one callbacks state (rank 0's) beside the per-rank RNG list.
    old = tmp_path / "old"
    (old / "checkpoints").mkdir(parents=True)
    ckpt = torch.load(pair["ddp"] / "checkpoints" / "step_00000003.pt", weights_only=True)
    ckpt["callbacks"] = [entry.pop("callbacks") for entry in ckpt["rng"]][0]
    torch.save(ckpt, old / "checkpoints" / "step_00000003.pt")
    done = train_ranks(old, *JOB, "trainer.max_steps=4")
    assert [_read(old, "loaded", rank) for rank in (0, 1)] == [saved[0], saved[0]]
    assert not any("callbacks" in log for log in done.logs), done.logs  # no "starting fresh"


@pytest.mark.slow
def test_each_rank_resumes_its_own_callback_state_from_a_sharded_checkpoint(
    pair: dict[str, Path], tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(pair["fsdp2"], run)
    saved = [_read(run, "saved", rank) for rank in (0, 1)]
    assert [s["rank"] for s in saved] == [0, 1]
    train_ranks(run, *JOB, *WRAPPERS["fsdp2"], "trainer.max_steps=4")
    assert [_read(run, "loaded", rank) for rank in (0, 1)] == saved


def test_a_dtensor_logged_on_one_rank_stops_every_rank_in_one_line(tmp_path: Path) -> None:
    done = train_ranks(
        tmp_path, *JOB[:3], "+callbacks.first._target_=helpers.rank_state.RankZeroGradNorm",
        "ddp=fsdp2", "trainer.max_steps=2", return_exceptions=True, timeout=120,
    )  # fmt: skip
    for rank in (0, 1):
        assert isinstance(done[rank], UserError), done[rank]
        assert str(done[rank]) == (
            "callbacks.first: ctx.log value 'grad/first' in on_before_optimizer_step is a "
            "DTensor (ddp=fsdp2: each rank holds a part), logged on rank(s) [0] of 2: its whole "
            "value needs every rank, so log it on every rank (then check ctx.rank elsewhere), "
            "or call .full_tensor() on it on every rank and log the result where you like"
        )


@pytest.mark.slow
def test_a_launched_single_rank_under_fsdp2_logs_whole_values(tmp_path: Path) -> None:
    # One rank with a process group (torchrun --nproc_per_node=1): fully_shard over a mesh of
    # one, the gradients still DTensors.
    train_ranks(tmp_path, *JOB, "ddp=fsdp2", "trainer.max_steps=1", world_size=1)
    norms = _grad_norms(tmp_path, 0)
    assert sorted(norms) == [1] and len(norms[1]) == 6
    assert norms[1] == pytest.approx(_grad_norms(tmp_path, 0, "whole/")[1], rel=1e-6)


@pytest.mark.slow
def test_sync_batchnorm_converts_and_is_refused_on_cpu_ranks(tmp_path: Path) -> None:
    done = train_ranks(
        tmp_path / "two", *JOB[:3], "ddp.sync_batchnorm=true", "trainer.max_steps=1",
        return_exceptions=True,
    )  # fmt: skip
    for rank in (0, 1):
        assert isinstance(done[rank], UserError), done[rank]
        assert str(done[rank]).startswith("ddp.sync_batchnorm=true: torch's SyncBatchNorm runs")
    # One process: converted (SyncBatchNorm only syncs with several), and the checkpoint keeps
    # BatchNorm's keys.
    train_here(tmp_path / "one", *JOB[:3], "ddp.sync_batchnorm=true", "trainer.max_steps=2")
    saved = checkpoint.load(checkpoint.latest(tmp_path / "one"))["model"]
    assert int(saved["net.1.num_batches_tracked"]) == 2
