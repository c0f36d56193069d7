"""A test-only model with a parameter that never takes part in the loss.

Used as `model=mlp model._target_=unused_model.MLPWithUnusedHead` (tests/ on PYTHONPATH): the
MLP config's fields build it, and `spare` gets no gradient in any step, which DDP refuses
unless ddp.find_unused_parameters=true (ddp=unused_params).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from hydra_ddp.models import MLP


class MLPWithUnusedHead(MLP):
    def __init__(self, cfg, spec):
        super().__init__(cfg, spec)
        self.spare = nn.Linear(cfg.hidden, spec.num_classes)  # never called in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)
