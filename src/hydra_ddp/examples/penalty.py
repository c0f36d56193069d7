"""A gradient penalty: the loss reads the whole batch (its inputs) and adds the squared norm of
the gradient of the model's output with respect to them, which smooths the classifier.
`experiment=gradient_penalty` (digits, MLP).

Under DDP the penalty's gradient is taken with respect to the inputs only
(`torch.autograd.grad(..., inputs=x)`), so no parameter gradient is accumulated twice and DDP's
all-reduce runs once, in the final backward."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class InputGradientMLP(nn.Module):
    """An MLP whose inputs require grad while training, so a loss can differentiate by them."""

    def __init__(self, in_features: int, out_features: int, hidden: int = 128):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(in_features, hidden), nn.Tanh(), nn.Linear(hidden, out_features)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            x.requires_grad_(True)
        return self.net(x)


class GradientPenaltyLoss:
    """Cross-entropy plus `weight` x the mean squared input-gradient norm of the logits."""

    def __init__(self, weight: float = 0.1) -> None:
        self.weight = weight

    def __call__(self, output: torch.Tensor, target: torch.Tensor, batch) -> dict:
        ce = F.cross_entropy(output, target)
        x = batch[0]
        if not x.requires_grad:  # evaluation: no graph to differentiate
            return {"loss": ce, "penalty": torch.zeros((), device=ce.device)}
        (grad,) = torch.autograd.grad(output.logsumexp(1).sum(), inputs=x, create_graph=True)
        penalty = grad.pow(2).flatten(1).sum(1).mean()
        return {"loss": ce + self.weight * penalty, "penalty": penalty.detach()}
