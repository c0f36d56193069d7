"""The project's configs compose over the engine's, and what they name builds and runs."""

from __future__ import annotations

import math

import numpy as np
import torch
from hydra_ddp.api import build, compose

from myproj.train import CONF


def test_the_project_layers_its_choices_over_the_engine() -> None:
    cfg = compose(CONF, "myproj", ["model.hidden=32"])
    assert cfg.model["_target_"] == "myproj.model.MLP" and cfg.model["hidden"] == 32
    assert cfg.data["_target_"] == "myproj.data.Blobs"
    assert cfg.loss["_target_"] == "myproj.loss.FocalLoss"
    assert cfg.logger.project == "myproj"
    assert cfg.trainer.epochs == 10  # data/myproj.yaml's, over the engine's default
    assert "acc" in cfg.metrics  # the engine's metrics group, chosen by data/myproj.yaml


def test_the_engine_presets_still_win() -> None:
    cfg = compose(CONF, "myproj", ["debug=fast"])
    assert cfg.trainer.max_steps == 3 and cfg.logger.sink is None  # debug=fast: logger=none


def test_the_components_build_and_give_a_finite_loss() -> None:
    cfg = compose(CONF, "myproj", ["data.rows=200"])
    source = build(cfg.data, "data")
    assert sum(source.num_rows(s) for s in ("train", "val", "test")) == 200
    model = build(cfg.model, "model", **source.spec)
    x, y = source.load("train", None)[np.arange(16)]
    logits = model(x)
    assert logits.shape == (16, cfg.data["classes"])
    loss = build(cfg.loss, "loss")(logits, y)
    assert math.isfinite(loss.item())
    # gamma=0 is plain cross-entropy.
    plain = build({**cfg.loss, "gamma": 0.0}, "loss")(logits, y)
    assert torch.allclose(plain, torch.nn.functional.cross_entropy(logits, y))
