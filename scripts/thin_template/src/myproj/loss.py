"""The objective: focal loss, cross-entropy that down-weights the examples already right.

The engine calls a loss as `loss(output, target)` (or with parameters named `batch` and
`model`, if it asks for them) and expects a scalar, or a dict with `loss` and extra terms to
log next to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FocalLoss(nn.Module):
    """Mean of (1 - p_true)^gamma * cross-entropy; gamma=0 is plain cross-entropy."""

    def __init__(self, gamma: float) -> None:
        super().__init__()
        self.gamma = gamma

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        log_p = F.log_softmax(logits.float(), dim=-1).gather(-1, target[:, None]).squeeze(-1)
        return (-((1 - log_p.exp()) ** self.gamma) * log_p).mean()
