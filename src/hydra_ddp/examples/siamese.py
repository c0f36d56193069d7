"""A two-input model with an auxiliary loss term that shows as its own curve.

`DigitPairs` yields `(left, right, same)`: two digit images and whether they show the same
digit. A tuple batch is `(inputs..., target)`, so the model is called as `model(left, right)`.
`SiameseNet` embeds both and classifies the pair; `contrastive_loss` returns a dict: the loss
plus its parts, each logged per rank as `loss_<name>`. `experiment=siamese`."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

from hydra_ddp.data import SPLITS, split_digits


class DigitPairs(Dataset):
    """`pairs` pairs of one split of the digits (the rows of `hydra_ddp.data.Digits`)."""

    def __init__(
        self,
        split: str,
        pairs: int = 1024,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        split_seed: int = 0,
    ) -> None:
        x, y, rows = split_digits(val_fraction, test_fraction, split_seed)
        self.x, self.y = torch.from_numpy(x[rows[split]]), torch.from_numpy(y[rows[split]])
        self.pairs, self.seed = pairs, SPLITS.index(split) + 1

    def __len__(self) -> int:
        return self.pairs

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + i)
        a = int(torch.randint(0, len(self.y), (1,), generator=g))
        if i % 2:  # half the pairs show the same digit
            same = (self.y == self.y[a]).nonzero().flatten()
            b = int(same[torch.randint(0, len(same), (1,), generator=g)])
        else:
            b = int(torch.randint(0, len(self.y), (1,), generator=g))
        return self.x[a], self.x[b], (self.y[a] == self.y[b]).long()


class SiameseNet(nn.Module):
    def __init__(self, in_features: int = 64, width: int = 64):
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(in_features, width), nn.ReLU(), nn.Linear(width, 32))
        self.classify = nn.Linear(32 * 2, 2)

    def forward(self, left: torch.Tensor, right: torch.Tensor) -> dict[str, torch.Tensor]:
        a, b = self.embed(left), self.embed(right)
        logits = self.classify(torch.cat([(a - b).abs(), a * b], dim=1))
        return {"logits": logits, "left": a, "right": b}


def contrastive_loss(output: dict, target: torch.Tensor, margin: float = 1.0, aux: float = 0.1):
    """Cross-entropy on same/different, plus `aux` times a contrastive term on the embeddings
    (close for the same digit, at least `margin` apart otherwise)."""
    ce = F.cross_entropy(output["logits"], target)
    distance = (output["left"] - output["right"]).norm(dim=1)
    same = target.float()
    contrastive = (same * distance**2 + (1 - same) * F.relu(margin - distance) ** 2).mean()
    return {"loss": ce + aux * contrastive, "ce": ce.detach(), "contrastive": contrastive.detach()}
