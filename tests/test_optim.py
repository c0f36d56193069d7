"""hydra_ddp.optim: GradClipper against torch's clip_grad_norm_, the schedule's shape."""

from __future__ import annotations

import math

import pytest
import torch

from hydra_ddp.config import OptimConfig, Schedule
from hydra_ddp.optim import GradClipper, build_optimizer, build_scheduler


def _model_with_grads(scale: float, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    model.to(dtype)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * scale
    return model


@pytest.mark.parametrize("scale", [1e-3, 10.0])  # below and above max_norm
@pytest.mark.parametrize("max_norm", [0.0, 1.0])  # 0: norm only, no clipping
def test_grad_clipper_matches_clip_grad_norm(scale: float, max_norm: float) -> None:
    ours, theirs = _model_with_grads(scale), _model_with_grads(scale)
    norm = GradClipper(ours, max_norm)()
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(),
                                          max_norm if max_norm > 0 else math.inf)
    torch.testing.assert_close(norm, want)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    if max_norm and scale > 1:  # it really clipped
        clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ours.parameters()]))
        assert clipped == pytest.approx(max_norm, rel=1e-4)


def test_grad_clipper_reports_non_finite_and_skips_missing_grads() -> None:
    model = _model_with_grads(1.0)
    model[0].weight.grad[0, 0] = float("inf")
    assert not math.isfinite(GradClipper(model, 1.0)())
    model = _model_with_grads(1.0)
    model[2].bias.grad = None  # a parameter that took no part in this step
    before = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    norm = GradClipper(model, 0.0)()
    want = torch.linalg.vector_norm(torch.stack([g.norm() for g in before if g is not None]))
    torch.testing.assert_close(norm, want)


def test_grad_clipper_mixed_dtypes_fall_back_to_torch() -> None:
    def mixed() -> torch.nn.Module:
        model = _model_with_grads(10.0)
        model[2].to(torch.float64)
        for p in model[2].parameters():
            p.grad = torch.full_like(p, 10.0)
        return model

    model, reference = mixed(), mixed()
    norm = GradClipper(model, 1.0)()
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    torch.testing.assert_close(norm, want)
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_warmup_then_cosine_to_min_lr() -> None:
    cfg = OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    model = _model_with_grads(1.0)
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg, total_steps=20)
    lrs = []
    for _ in range(20):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))  # decays monotonically
    assert lrs[-1] == pytest.approx(0.1, abs=0.02)
    constant = OptimConfig(lr=1.0, warmup_steps=0, schedule=Schedule.constant)
    sched = build_scheduler(build_optimizer(model, constant), constant, total_steps=20)
    assert sched.get_last_lr() == [1.0, 1.0]
