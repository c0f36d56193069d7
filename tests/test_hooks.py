"""The hooks that see a step's tensors, through the real loop on two gloo ranks (helpers/ranks.py)
with user code outside the package, by config alone: a callback logs every layer's gradient
norm from on_before_optimizer_step (the gradients as averaged over the ranks, before clipping),
on_step_end's ctx carries the step's micro-batches, outputs and losses, and an epoch-stepped
schedule (scheduler=epoch_step) changes the learning rate exactly at the epoch boundaries.
Also: a step with two optimizers (experiment=gan) calls the hook before each, naming it, and
under a grad scaler the hook sees the unscaled gradients (StepTools directly: fp16 needs CUDA)."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import FAST
from helpers.inproc import train_here, train_ranks

from hydra_ddp.step import StepTools

CLIP = 0.001  # far below the gradients' norms: clipping changes every gradient


def _rows(job: Path, rank: int) -> dict[int, dict]:
    """The rank's stats rows, merged by step (stats and each ctx.log are rows of their own)."""
    merged: dict[int, dict] = {}
    for line in (job / "stats" / f"rank{rank}.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "step" in row:
            merged.setdefault(row["step"], {}).update(row)
    return merged


def test_two_ranks_log_layer_grad_norms_see_step_tensors_and_step_lr_by_epoch(
    tmp_path: Path,
) -> None:
    # limit_train_batches=4 with grad_accum=2: 2 steps per epoch, 3 epochs are 6 steps.
    summaries = train_ranks(
        tmp_path, *FAST, "+callbacks.grads._target_=helpers.user_hooks.LayerGradNorms",
        "+callbacks.contents._target_=helpers.user_hooks.StepContents", "scheduler=epoch_step",
        "trainer.limit_train_batches=4", "trainer.grad_accum=2", "trainer.epochs=3",
        "trainer.log_interval=1", f"trainer.grad_clip={CLIP}",
    )  # fmt: skip
    assert summaries[0]["steps"] == summaries[1]["steps"] == 6
    rows = [_rows(tmp_path, rank) for rank in (0, 1)]
    lr0 = rows[0][1]["lr"]
    for rank in (0, 1):
        calls = json.loads((tmp_path / f"grad_calls_rank{rank}.json").read_text())
        assert calls == [[step, "default"] for step in range(1, 7)]  # once per optimizer step
        for step in range(1, 7):
            row = rows[rank][step]
            layers = {k: v for k, v in row.items() if k.startswith("grad/")}
            assert {"grad/net.0.weight", "grad/net.0.bias"} <= set(layers), sorted(row)
            # The per-layer norms make up the norm the loop clipped, as it was before clipping.
            total = math.sqrt(sum(v * v for v in layers.values()))
            assert total == pytest.approx(row["grad_norm"], rel=1e-5)
            assert row["grad_norm"] > 10 * CLIP
            # Averaged over the ranks by then: the same on both.
            assert layers == pytest.approx(
                {k: v for k, v in rows[1 - rank][step].items() if k.startswith("grad/")}, rel=1e-5
            )
            # on_step_end: the step's two micro-batches and their outputs give its loss.
            assert row["micro_batches"] == 2
            assert row["recomputed_loss"] == pytest.approx(row["loss"], rel=1e-5)
            assert row["ctx_loss"] == pytest.approx(row["loss"], rel=1e-6)
            # StepLR(step_size=1, gamma=0.5) by epoch: halved after steps 2 and 4, not between.
            assert row["lr"] == pytest.approx(lr0 * 0.5 ** ((step - 1) // 2), rel=1e-9)
    assert lr0 == pytest.approx(0.002)  # optim=adamw's lr, untouched until the first epoch ends


def test_a_step_with_two_optimizers_calls_the_hook_before_each_naming_it(tmp_path: Path) -> None:
    # experiment=gan's step: tools.step(discriminator), then tools.step(generator).
    train_here(
        tmp_path, *FAST, "experiment=gan", "trainer.max_steps=2", "trainer.log_interval=1",
        "+callbacks.grads._target_=helpers.user_hooks.LayerGradNorms",
    )  # fmt: skip
    calls = json.loads((tmp_path / "grad_calls_rank0.json").read_text())
    assert calls == [[s, o] for s in (1, 2) for o in ("discriminator", "generator")]
    logged = _rows(tmp_path, 0)[2]
    assert any(k.startswith("grad/generator.") for k in logged)
    assert any(k.startswith("grad/discriminator.") for k in logged)


def test_under_a_grad_scaler_the_hook_sees_unscaled_unclipped_gradients() -> None:
    # fp16 runs need CUDA; its GradScaler works the same on CPU, and StepTools is what calls
    # the hook, so the step's machinery is tested here directly.
    torch.manual_seed(0)
    model, x, y = torch.nn.Linear(4, 3), torch.randn(8, 4), torch.randint(0, 3, (8,))
    loss_fn = torch.nn.functional.cross_entropy
    loss_fn(model(x), y).backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tools = StepTools(scaler, contextlib.nullcontext(), CLIP, optimizers={"main": optimizer})
    seen: list = []
    tools.before_step = lambda name: seen.append(
        (name, [p.grad.clone() for p in model.parameters()])
    )
    before = [p.detach().clone() for p in model.parameters()]
    tools.backward(model, [(x, y)], loss_fn)
    norm = tools.step(optimizer)
    assert [name for name, _ in seen] == ["main"]
    for got, want in zip(seen[0][1], reference):
        torch.testing.assert_close(got, want)  # unscaled and not yet clipped
    assert float(norm) > 10 * CLIP
    assert all(p.grad is None for p in model.parameters())  # zero_grad came after the hook
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # it stepped
