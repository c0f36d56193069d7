"""Example losses: `loss(output, target) -> scalar tensor`, chosen with `loss=<name>`.

Any callable of that shape is a loss here, e.g. `_target_: torch.nn.MSELoss` (conf/loss/mse.yaml).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hydra_ddp.components import check


class CrossEntropy(nn.Module):
    """Mean cross-entropy over every position, classes on the last axis: (B, C) logits with
    (B,) targets for classification, (B, T, V) with (B, T) for next-token prediction. Computed
    in float32 even under bf16/fp16 autocast."""

    def __init__(self, label_smoothing: float):
        super().__init__()
        check(0 <= label_smoothing < 1, "label_smoothing", "in [0, 1)", label_smoothing)
        self.label_smoothing = label_smoothing

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            target.reshape(-1),
            label_smoothing=self.label_smoothing,
        )
