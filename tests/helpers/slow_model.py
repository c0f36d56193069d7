"""A test-only model whose forward sleeps: the slow steps of a large model, on a CPU.

Used as `model=mlp model._target_=helpers.slow_model.SlowMLP +model.sleep_s=3` (tests/ on
PYTHONPATH).
"""

from __future__ import annotations

import time

import torch

from hydra_ddp.models import MLP


class SlowMLP(MLP):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        hidden: int,
        depth: int,
        dropout: float,
        sleep_s: float = 3.0,
    ):
        super().__init__(in_features, out_features, hidden, depth, dropout)
        self.sleep_s = sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.sleep_s)
        return super().forward(x)
