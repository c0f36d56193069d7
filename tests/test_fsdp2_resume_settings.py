"""A ddp=fsdp2 resume applies changed optim.* settings as a DDP resume does (the same checkpoint
member, checkpoint.state.OptimizerState): on 2 gloo ranks, a sharded checkpoint written with
optim.lr=0.002 and weight_decay=0.01 resumes with 0.02 and 0.3, says so, trains with them, and
its next checkpoint holds them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import FAST
from helpers.inproc import train_ranks
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

# A constant rate: the logged lr is the configured one.
COMMON = [*FAST, "ddp=fsdp2", "trainer.ckpt_interval=2", "trainer.log_interval=1",
          "scheduler=constant", "scheduler.warmup_steps=0"]  # fmt: skip


@pytest.mark.slow
def test_an_fsdp2_resume_applies_changed_optim_settings(tmp_path: Path) -> None:
    train_ranks(tmp_path, *COMMON, "trainer.max_steps=2")
    resumed = train_ranks(
        tmp_path, *COMMON, "trainer.max_steps=4", "optim.lr=0.02", "optim.weight_decay=0.3"
    )
    assert resumed[0]["steps_this_run"] == 2
    log = resumed.logs[0]
    assert "optim.lr 0.002 -> 0.02 (changed since" in log, log
    assert "optim.weight_decay 0.01 -> 0.3 (changed since" in log, log
    rows = [
        json.loads(ln) for ln in (tmp_path / "stats" / "rank0.jsonl").read_text().split("\n") if ln
    ]
    lrs = {r["step"]: r["lr"] for r in rows if "lr" in r}
    assert lrs[2] == 0.002 and lrs[3] == lrs[4] == 0.02, lrs

    whole = tmp_path / "step4.pt"
    dcp_to_torch_save(tmp_path / "checkpoints" / "step_00000004.dcp", whole)
    groups = torch.load(whole, weights_only=False)["optimizer"]["default"]["param_groups"]
    assert {g["initial_lr"] for g in groups} == {0.02}
    # The decay split: weights decay at the new rate, biases and norms still not at all.
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.3]
