"""Example evaluation metrics (`metrics=<name>`); a metric of yours is a class like these
(the contract: `hydra_ddp.protocols.Metric`). Only sums cross ranks, so each metric is exact
however the rows are split.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from hydra_ddp.batches import IGNORE_INDEX


class Metric:
    """A base with the default `gathers`."""

    gathers = False  # True: sums() gathers every rank's rows

    def sums(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """Sums over one batch (a 1-D tensor on the output's device). Name a parameter `batch`
        instead of the target to get the whole batch."""
        raise NotImplementedError

    def compute(self, totals: list[float]) -> float:
        raise NotImplementedError


def _count(target: torch.Tensor) -> torch.Tensor:
    # On the target's device: stacked with sums that live there.
    return torch.full((), target.numel(), dtype=torch.float64, device=target.device)


def logits_of(output: Any) -> torch.Tensor:
    """A model's logits: the output itself, or its `logits` (a dict's, or a Hugging Face output
    object's)."""
    if isinstance(output, Mapping):
        return output["logits"]
    return getattr(output, "logits", output)


class Accuracy(Metric):
    """Share of positions whose argmax over the last axis is the target (padding excluded)."""

    def sums(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        valid = target != IGNORE_INDEX  # padding (-100, as in Hugging Face labels) excluded
        right = ((logits_of(output).argmax(-1) == target) & valid).sum()
        return torch.stack([right.double(), valid.sum().double()])

    def compute(self, totals: list[float]) -> float:
        return totals[0] / max(totals[1], 1)


class Perplexity(Metric):
    """exp of the mean next-token negative log-likelihood (without label smoothing), over the
    positions that are not padding (IGNORE_INDEX)."""

    def sums(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        logits = logits_of(output)
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            target.reshape(-1),
            reduction="sum",
            ignore_index=IGNORE_INDEX,
        )
        valid = (target != IGNORE_INDEX).sum()
        return torch.stack([nll.double(), valid.double()])

    def compute(self, totals: list[float]) -> float:
        return math.exp(min(totals[0] / max(totals[1], 1), 700.0))


class BitsPerToken(Perplexity):
    """Mean negative log-likelihood in bits: bits per character on a character-level corpus."""

    def compute(self, totals: list[float]) -> float:
        return totals[0] / max(totals[1], 1) / math.log(2)


class MeanSquaredError(Metric):
    def sums(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        err = (output.double() - target.double().view_as(output)) ** 2
        return torch.stack([err.sum(), _count(target)])

    def compute(self, totals: list[float]) -> float:
        return totals[0] / max(totals[1], 1)


class R2Score(Metric):
    """Coefficient of determination, 1 - SSE / SST, over all targets of the split."""

    def sums(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        y = target.double().view_as(output)
        return torch.stack([((output.double() - y) ** 2).sum(), y.sum(), (y**2).sum(), _count(y)])

    def compute(self, totals: list[float]) -> float:
        sse, total, squares, n = totals
        sst = squares - total * total / max(n, 1)
        return 1.0 - sse / sst if sst > 0 else float("nan")
