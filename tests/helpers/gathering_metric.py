"""A metric that gathers every rank's rows in `sums` (tests/ on PYTHONPATH): accuracy over
the whole global batch, computed from what `gather_for_metrics` hands back, so it equals the
template's own Accuracy only if every real row is seen exactly once and no padding is."""

from __future__ import annotations

import torch

from hydra_ddp.distributed import gather_for_metrics
from hydra_ddp.metrics import Metric


class GatheredAccuracy(Metric):
    gathers = True

    def sums(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        predicted = gather_for_metrics(output.argmax(-1))  # collective
        target = gather_for_metrics(target)  # collective
        right = (predicted == target).sum().double()
        return torch.stack([right, torch.full_like(right, len(target))])

    def compute(self, totals: list[float]) -> float:
        return totals[0] / max(totals[1], 1)
