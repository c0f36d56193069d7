"""A planted mistake for `python -m hydra_ddp.check` (tests/test_check.py): a forward that
depends on a plain attribute (`calls`) that changes every step and that no checkpoint holds, so
a resumed run silently differs from an uninterrupted one.
`model._target_=helpers.unsaved_state_model.CountingMLP` (tests/ on PYTHONPATH)."""

from __future__ import annotations

import torch

from hydra_ddp.models import MLP


class CountingMLP(MLP):
    def __init__(
        self, in_features: int, out_features: int, hidden: int, depth: int, dropout: float
    ) -> None:
        super().__init__(in_features, out_features, hidden, depth, dropout)
        self.calls = 0  # not a buffer: no state_dict, no checkpoint holds it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        return super().forward(x) * (1.0 + 0.01 * min(self.calls, 50))
