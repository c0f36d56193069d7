"""A planted mistake for `python -m hydra_ddp.check` (tests/test_check.py): randomness of the
user's own that no seed fixes (Python's `random`, seeded from the OS in every process), so two
runs with the same trainer.seed differ. `model._target_=helpers.unseeded_model.JitteryMLP`
(tests/ on PYTHONPATH)."""

from __future__ import annotations

import random

import torch

from hydra_ddp.models import MLP


class JitteryMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * (1.0 + 1e-3 * random.random())  # "a little noise helps"
