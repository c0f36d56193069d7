"""A planted mistake for `python -m hydra_ddp.check` (tests/test_check.py): a model that changes
a parameter in place during forward by an amount that depends on the rank, so the ranks' weights
drift apart while DDP averages only the gradients.
`model._target_=helpers.drifting_model.DriftingMLP` (tests/ on PYTHONPATH)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hydra_ddp.models import MLP


class DriftingMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank = dist.get_rank() if dist.is_initialized() else 0
        with torch.no_grad():
            self.net[0].bias.add_(1e-4 * rank)  # "a small correction", different on each rank
        return super().forward(x)
