"""Test-only models whose outputs are not one tensor (tests/ on PYTHONPATH), built from the MLP
config's arguments: a tuple, and a dict without `logits`; each with a loss that reads it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hydra_ddp.models import MLP


class TupleOut(MLP):
    """(logits, probabilities, a scalar): the scalar has no row per batch row."""

    def forward(self, x: torch.Tensor):  # type: ignore[override]
        logits = super().forward(x)
        return logits, logits.softmax(-1), logits.square().mean()


class DictOut(MLP):
    """{scores, embedding (x's first 3 features, doubled), aux (a scalar)}: no `logits`."""

    def forward(self, x: torch.Tensor):  # type: ignore[override]
        return {"scores": super().forward(x), "embedding": 2 * x[:, :3], "aux": x.mean()}


def scores_loss(output, target: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    scores = output[0] if isinstance(output, tuple) else output["scores"]
    return F.cross_entropy(scores, target, label_smoothing=label_smoothing)


class FailsOnRank1(MLP):
    """Raises in its forward on rank 1 only (of a launched job)."""

    def forward(self, x: torch.Tensor):  # type: ignore[override]
        import os

        if os.environ.get("RANK") == "1":
            raise ValueError("boom on rank 1")
        return super().forward(x)
