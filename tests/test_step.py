"""The training step and the schedules, in process: the loop's step (`default_step` with
`StepTools`, called as loop.fit calls it) does exactly what the textbook loop does, gradient
accumulation equals the big batch, a non-finite step is not applied, and the example schedules
have their documented shape."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from hydra_ddp.batches import BatchLoss
from hydra_ddp.losses import CrossEntropy
from hydra_ddp.models import MLP
from hydra_ddp.optim import param_groups, warmup_constant, warmup_cosine
from hydra_ddp.step import StepTools, default_step

FP32 = contextlib.nullcontext()


def loop_step(model, micro_batches, loss_fn, optimizer, scaler, max_norm: float):
    """One step as loop.fit runs it: the step over the micro-batches, then `tools.update()`.
    Returns the mean loss and the gradient norm before clipping."""
    tools = StepTools(scaler, FP32, max_norm, skip_non_finite=True, raw_model=model)
    losses = default_step(tools, model, micro_batches, BatchLoss(loss_fn), {"default": optimizer})
    return losses["loss"], tools.update()


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = MLP(in_features=8, out_features=3, hidden=16, depth=2, dropout=0.0)
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2, weight_decay=0.1)
    return model, opt, torch.amp.GradScaler("cpu", enabled=False)


def _data(n: int = 32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_the_loops_step_is_the_textbook_step() -> None:
    x, y = _data()
    ours, opt, scaler = _setup()
    ref, ref_opt, _ = _setup()
    loss_fn = CrossEntropy(label_smoothing=0.0)
    for _ in range(5):
        loss, norm = loop_step(ours, [(x, y)], loss_fn, opt, scaler, max_norm=0.5)
        ref_loss = torch.nn.functional.cross_entropy(ref(x), y)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        torch.testing.assert_close(loss, ref_loss.detach())
        torch.testing.assert_close(norm, ref_norm)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)
    assert all(p.grad is None for p in ours.parameters())


def test_accumulated_micro_batches_equal_one_big_batch() -> None:
    x, y = _data()
    one, opt1, scaler = _setup()
    four, opt4, _ = _setup()
    loss_fn = CrossEntropy(label_smoothing=0.0)
    big, _ = loop_step(one, [(x, y)], loss_fn, opt1, scaler, max_norm=1.0)
    micro = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)]
    acc, _ = loop_step(four, micro, loss_fn, opt4, scaler, max_norm=1.0)
    torch.testing.assert_close(acc, big)
    for a, b in zip(one.parameters(), four.parameters()):
        torch.testing.assert_close(a, b)


def test_non_finite_gradients_skip_the_update() -> None:
    x, y = _data()
    model, opt, scaler = _setup()
    before = [p.detach().clone() for p in model.parameters()]
    x = x.clone()
    x[0, 0] = float("nan")
    loss, norm = loop_step(
        model, [(x, y)], CrossEntropy(label_smoothing=0.0), opt, scaler, max_norm=1.0
    )
    assert not torch.isfinite(norm) and not torch.isfinite(loss)
    for a, b in zip(model.parameters(), before):
        assert torch.equal(a, b)


def test_param_groups_exempt_biases_from_weight_decay() -> None:
    model, opt, _ = _setup()
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.ndim == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.ndim == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def _lrs(sched, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0])
        sched.optimizer.step()
        sched.step()
    return out


def test_warmup_cosine_shape() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    lrs = _lrs(warmup_cosine(opt, total_steps=20, warmup_steps=4, min_lr_ratio=0.1), 21)
    assert lrs[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert lrs[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert lrs[20] == pytest.approx(0.1)


def test_warmup_constant_shape() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    lrs = _lrs(warmup_constant(opt, total_steps=20, warmup_steps=0), 20)
    assert lrs == pytest.approx([1.0] * 20)
    assert math.isclose(lrs[-1], 1.0)
