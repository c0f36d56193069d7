"""Evaluation gives every rank the same batches (batch i the same size on each; a rank short of
rows evaluates padding that counts for nothing), so a loss or metric that gathers pairs its
collectives on any split of the rows, and gives exactly the one-process value."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ranks
from helpers.gathering_metric import GatheredAccuracy

from hydra_ddp.data import EvalData, InMemoryArrays
from hydra_ddp.data.view import boundaries
from hydra_ddp.distributed import DistEnv
from hydra_ddp.loop.scoring import evaluate, predict
from hydra_ddp.losses import CrossEntropy
from hydra_ddp.metrics import Accuracy

_STRIDED = {"_target_": "hydra_ddp.data.Strided", "shuffle": False, "seed": 0, "drop_last": False}
_SHARDED = {**_STRIDED, "_target_": "hydra_ddp.data.Sharded", "shard_by": "rows",
            "rotate": False}  # fmt: skip


class _Rows201(InMemoryArrays):
    """201 test rows: with batch 100 on 2 ranks, one rank holds 2 batches, the other 1."""

    def __init__(self) -> None:
        g = np.random.default_rng(0)
        x, y = g.normal(size=(201, 8)).astype(np.float32), g.integers(0, 3, 201)
        self.arrays = {s: (x, y) for s in ("train", "val", "test")}
        self.spec = {"in_features": 8, "out_features": 3}


def _scores(env: DistEnv, sampler: dict, out: str) -> dict[str, float]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    split = EvalData(_Rows201(), "test", sampler, env, 100)
    metrics = {"acc": Accuracy(), "gathered": GatheredAccuracy()}
    nothing = contextlib.nullcontext()
    scores = evaluate(model, split, env, CrossEntropy(0.0), metrics, nothing)  # collective
    predict(model, split, env, nothing, Path(out))  # collective
    return scores


@pytest.mark.parametrize("sampler", [_STRIDED, _SHARDED], ids=["strided", "sharded"])
def test_a_gathering_metric_on_uneven_shards_gives_the_one_process_value(tmp_path, sampler):
    alone = _scores(DistEnv(), sampler, str(tmp_path / "one.pt"))
    both = ranks.run(_scores, sampler, str(tmp_path / "two.pt"), world_size=2, timeout=60)
    metrics = ("acc", "gathered")
    assert alone["gathered"] == alone["acc"]
    for scores in both:  # exactly: every row once, the padding nowhere
        assert {k: scores[k] for k in metrics} == {k: alone[k] for k in metrics}, scores
        # The loss is a float32 mean per batch, and the batches differ from one process's.
        assert scores["loss"] == pytest.approx(alone["loss"], rel=1e-6)
    # Predictions: every row once, in the split's order, none of the padding.
    assert torch.equal(torch.load(tmp_path / "two.pt"), torch.load(tmp_path / "one.pt"))


def test_batches_are_cut_at_every_rank_count() -> None:
    assert boundaries([101, 100], 100) == [(0, 100), (100, 101)]
    assert boundaries([149, 148], 16)[-3:] == [(128, 144), (144, 148), (148, 149)]
    assert boundaries([3, 0], 2) == [(0, 2), (2, 3)]
    assert boundaries([0, 0], 4) == []
