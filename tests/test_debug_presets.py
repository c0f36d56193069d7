"""The debug/ presets (lightning-hydra-template's convention): debug=fast, overfit, limit,
profile, anomaly, each composed as on the command line and run in process, on 2 real gloo ranks
(helpers/ranks.py) where the preset is about every rank, on one rank here otherwise."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import summary
from helpers.inproc import isolated, job, train, train_here, train_ranks

from hydra_ddp.distributed import DistEnv
from hydra_ddp.loop.scoring import evaluate
from hydra_ddp.models import MLP

pytestmark = pytest.mark.timeout(300)


def test_debug_fast_is_a_few_steps_and_a_short_eval_without_wandb(tmp_path: Path) -> None:
    job = tmp_path / "job"
    s = train_ranks(job, "debug=fast")[0]
    assert s["steps"] == 3 and s["world_size"] == 2
    assert not (job / "wandb").exists()  # logger=none
    assert (job / "checkpoints" / "step_00000003.pt").is_file()


def test_limit_eval_batches_reads_only_the_first_batches() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    batches = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(5)]
    loss = torch.nn.CrossEntropyLoss()
    scored = evaluate(model, batches, DistEnv(), loss, {}, contextlib.nullcontext(), limit=2)
    x, y = torch.cat([b[0] for b in batches[:2]]), torch.cat([b[1] for b in batches[:2]])
    assert scored["loss"] == pytest.approx(loss(model(x), y).item(), rel=1e-6)


def test_debug_overfit_drives_the_training_loss_near_zero(tmp_path: Path) -> None:
    job = tmp_path / "job"
    s = train_here(job, "debug=overfit", "model.dropout=0")
    assert s["steps"] == 300
    first = json.loads((job / "stats" / "rank0.jsonl").read_text().splitlines()[0])
    assert first["loss"] > 0.3, first  # it starts far from fitting...
    assert s["train_loss"] < 0.01, s["train_loss"]  # ...and fits its one batch
    assert s["epochs"] == 300  # one batch per epoch
    assert summary(job)["steps"] == 300


def test_debug_limit_caps_every_epoch_and_evaluation(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO)
    job = tmp_path / "job"
    s = train_here(job, "debug=limit", "logger=none", "trainer.progress=false")
    # 3 epochs of 10 batches (instead of digits' 20 at batch 64).
    assert s["steps"] == 30 and s["epochs"] == 3.0
    assert "step 10 | val" in caplog.text and "step 20 | val" in caplog.text
    assert sorted(p.name for p in (job / "checkpoints").glob("step_*.pt")) == [
        "step_00000020.pt",
        "step_00000030.pt",
    ]


def test_debug_profile_writes_a_trace_per_rank_and_the_top_ops(tmp_path: Path) -> None:
    job = tmp_path / "job"
    done = train_ranks(job, "debug=profile")
    for rank in (0, 1):
        trace = json.loads((job / "profile" / f"rank{rank}.pt.trace.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        # Training steps 6-10 (the profiler counts its steps from 0).
        assert {f"ProfilerStep#{i}" for i in range(5, 10)} <= names, rank
        assert "ProfilerStep#10" not in names and "ProfilerStep#4" not in names
        log = done.logs[rank]
        assert f"profile of steps 6-10 on rank {rank}" in log
        assert "Self CPU" in log and "aten::" in log  # the top ops table


class NaNInBackward(MLP):
    """The MLP plus a term whose forward is finite (sqrt(0) * 0) and whose backward is NaN
    (0 / sqrt(0)) in SqrtBackward only: without anomaly mode the step only sees a NaN norm."""

    def __init__(
        self, in_features: int, out_features: int, hidden: int, depth: int, dropout: float
    ) -> None:
        super().__init__(in_features, out_features, hidden, depth, dropout)
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + (x.flatten(1)[:, :1] * self.w).abs().sqrt() * 0


def test_debug_anomaly_names_the_backward_op_that_made_a_nan(tmp_path: Path, caplog) -> None:
    """debug=anomaly, composed as on the command line: the job stops at the backward op that
    produced the NaN (without it, trainer.nan_policy's check would report a non-finite norm),
    and the loop turns anomaly mode off again when the job ends, even on that error."""
    caplog.set_level(logging.INFO)
    overrides = ["debug=anomaly", "trainer.max_steps=3", "logger=none"]
    cfg, run = job(tmp_path / "job", *overrides, "model._target_=test_debug_presets.NaNInBackward")
    assert cfg.trainer.detect_anomaly
    assert not torch.is_anomaly_enabled()
    with isolated():
        torch.set_num_threads(1)
        # The error names the backward op; anomaly mode's warning, the forward line behind it.
        with (
            pytest.raises(RuntimeError, match="Function 'SqrtBackward0' returned nan"),
            pytest.warns(UserWarning, match=r"(?s)Error detected in SqrtBackward0.*\.sqrt\(\)"),
        ):
            train(cfg, DistEnv(), run)
        # Checked before isolated() puts the flag back: the loop's own scope must end it.
        assert not torch.is_anomaly_enabled()
    assert "autograd anomaly detection is on" in caplog.text
