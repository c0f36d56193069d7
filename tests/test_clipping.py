"""Per-optimizer clip thresholds: `trainer.grad_clip` as one number or a map by optimizer name.
The step tools clip each optimizer's parameters with its own threshold (checked on the update
plain SGD makes: lr 1, so the step is the clipped gradient), the GAN example trains with its
map, and a name that is no optimizer of the job is refused in one line naming those that are."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pytest
import torch
from conftest import FAST
from helpers.inproc import train_here, typed

from hydra_ddp.errors import UserError
from hydra_ddp.step import StepTools, default_step


def _two_optimizer_step(grad_clip):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    optimizers = {
        "first": torch.optim.SGD(model[0].parameters(), lr=1.0),
        "second": torch.optim.SGD(model[1].parameters(), lr=1.0),
    }
    before = {n: [p.detach().clone() for p in o.param_groups[0]["params"]]
              for n, o in optimizers.items()}  # fmt: skip
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    tools = StepTools(scaler, contextlib.nullcontext(), grad_clip, optimizers=optimizers)
    x = 100 * torch.randn(8, 4)  # large inputs: gradient norms far above the thresholds

    def loss_fn(output, target):
        return ((output - target) ** 2).mean()

    default_step(tools, model, [(x, torch.zeros(8, 1))], loss_fn, optimizers)
    moved = {}
    for name, optimizer in optimizers.items():
        params = optimizer.param_groups[0]["params"]
        deltas = [p.detach() - q for p, q in zip(params, before[name])]
        moved[name] = torch.linalg.vector_norm(torch.cat([d.flatten() for d in deltas])).item()
    return moved, [g.item() for g in tools.grad_norms]


def test_each_optimizer_is_clipped_to_its_own_threshold() -> None:
    moved, norms = _two_optimizer_step({"first": 0.5, "second": 0.25})
    assert all(n > 10 for n in norms), norms  # far above: the clip did act
    assert moved["first"] == pytest.approx(0.5, rel=1e-4)
    assert moved["second"] == pytest.approx(0.25, rel=1e-4)
    # One number: the same threshold for both. Left out of a map: not clipped at all.
    moved, _ = _two_optimizer_step(0.3)
    assert moved == pytest.approx({"first": 0.3, "second": 0.3}, rel=1e-4)
    moved, norms = _two_optimizer_step({"first": 0.5})
    assert moved["first"] == pytest.approx(0.5, rel=1e-4)
    assert moved["second"] == pytest.approx(norms[1], rel=1e-4)


def test_an_unknown_optimizer_name_is_refused_naming_the_optimizers() -> None:
    with pytest.raises(UserError, match=r"trainer\.grad_clip\.gen: .* generator, discriminator"):
        typed("experiment=gan", "+trainer.grad_clip.gen=1.0")
    with pytest.raises(UserError, match=r"no optimizer named 'generator'; .* default"):
        typed("trainer.grad_clip={generator:1.0}")
    with pytest.raises(UserError, match=r"trainer\.grad_clip\.default=-1 is not allowed"):
        typed("trainer.grad_clip={default:-1}")
    assert typed("trainer.grad_clip={default:0.5}").trainer.grad_clip == {"default": 0.5}
    with pytest.raises(UserError, match=r"no optimizer is named 'x'; the optimizers are first"):
        StepTools(None, None, {"x": 1.0}, optimizers={"first": None})


def test_the_gan_trains_with_a_threshold_per_optimizer(tmp_path: Path) -> None:
    # experiment=gan sets trainer.grad_clip={generator: 1.0, discriminator: 0.5}.
    assert typed("experiment=gan").trainer.grad_clip == {"generator": 1.0, "discriminator": 0.5}
    s = train_here(tmp_path, *FAST, "experiment=gan", "trainer.max_steps=8",
                   "trainer.log_interval=4")  # fmt: skip
    assert s["steps"] == 8 and math.isfinite(s["test_loss"])
