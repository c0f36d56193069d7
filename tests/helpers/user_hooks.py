"""A user's callbacks for the hooks that see a step's tensors (tests/ is on sys.path):
`+callbacks.grads._target_=helpers.user_hooks.LayerGradNorms` in test_hooks.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch


class LayerGradNorms:
    """Logs every layer's gradient norm (`grad/<parameter name>`) from on_before_optimizer_step,
    and writes the (step, optimizer) of each call to <output dir>/grad_calls_rank<r>.json."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []

    def on_before_optimizer_step(self, ctx) -> None:
        assert ctx.batch is None and ctx.outputs is None and ctx.losses is None
        self.calls.append((ctx.step, ctx.optimizer))
        ctx.log(
            {
                f"grad/{name}": p.grad.norm()
                for name, p in ctx.model.named_parameters()
                if p.grad is not None
            }
        )

    def on_train_end(self, ctx) -> None:
        assert ctx.optimizer is None
        out = Path(ctx.output_dir) / f"grad_calls_rank{ctx.rank}.json"
        out.write_text(json.dumps(self.calls))


class StepContents:
    """Recomputes each step's loss at on_step_end from ctx.batch and ctx.outputs (the mean
    cross-entropy over the micro-batches) and logs it with ctx.losses' loss; checks the
    tensors are gone by the next hook."""

    def on_step_end(self, ctx) -> None:
        assert len(ctx.batch) == len(ctx.outputs) >= 1
        assert not any(o.requires_grad for o in ctx.outputs)  # detached
        recomputed = sum(
            torch.nn.functional.cross_entropy(out, y) for out, (_, y) in zip(ctx.outputs, ctx.batch)
        ) / len(ctx.batch)
        ctx.log(
            {
                "recomputed_loss": float(recomputed),
                "ctx_loss": float(ctx.losses["loss"]),
                "micro_batches": len(ctx.batch),
            }
        )

    def on_epoch_end(self, ctx) -> None:
        assert ctx.batch is None and ctx.outputs is None and ctx.losses is None
        assert not math.isnan(float(ctx.loss))
