"""A test-only model with a parameter that never takes part in the loss.

Used as `model=mlp model._target_=helpers.unused_model.MLPWithUnusedHead` (tests/ on
PYTHONPATH): the MLP config's arguments build it, and `spare` gets no gradient in any step,
which DDP refuses unless ddp.find_unused_parameters=true (ddp=unused_params).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from hydra_ddp.models import MLP


class MLPWithUnusedHead(MLP):
    def __init__(
        self, in_features: int, out_features: int, hidden: int, depth: int, dropout: float
    ):
        super().__init__(in_features, out_features, hidden, depth, dropout)
        self.spare = nn.Linear(hidden, out_features)  # never called in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)
