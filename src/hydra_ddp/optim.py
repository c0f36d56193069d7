"""Parameter groups for the optimizer, and the example learning-rate schedules.

The optimizer itself is a component (`optim._target_`, e.g. torch.optim.AdamW), built with the
groups below as its `params`; the schedule is one too (`scheduler._target_`), built with the
optimizer and the run's total number of optimizer steps.
"""

from __future__ import annotations

import math

import torch

from hydra_ddp.components import check


def param_groups(model: torch.nn.Module) -> list[dict]:
    """Trainable parameters in two groups: matrices and embeddings take the optimizer's weight
    decay; biases and norm weights (1-D) take none, as in GPT-2 and most transformer recipes."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def warmup_cosine(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int, min_lr_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to the optimizer's lr over `warmup_steps`, then cosine decay to
    lr * min_lr_ratio at `total_steps`."""
    check(0 <= min_lr_ratio <= 1, "min_lr_ratio", "in [0, 1]", min_lr_ratio)
    return _warmup_then(
        optimizer,
        total_steps,
        warmup_steps,
        lambda progress: (
            min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        ),
    )


def warmup_constant(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to the optimizer's lr over `warmup_steps`, then constant."""
    return _warmup_then(optimizer, total_steps, warmup_steps, lambda progress: 1.0)


def _warmup_then(optimizer, total_steps, warmup_steps, after) -> torch.optim.lr_scheduler.LambdaLR:
    check(warmup_steps >= 0, "warmup_steps", ">= 0", warmup_steps)
    warmup = min(warmup_steps, max(total_steps - 1, 0))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return after(min((step - warmup) / max(total_steps - warmup, 1), 1.0))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
