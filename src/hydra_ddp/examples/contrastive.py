"""Contrastive learning with negatives from every rank (SimCLR's NT-Xent, Chen et al. 2020).
`experiment=contrastive`.

`DigitViews` yields `(view_a, view_b, digit)`: two random augmentations of one digit image, so
the model is called as `model(view_a, view_b)`; `Encoder` embeds both into unit vectors.
`nt_xent` scores each view against every view of the global batch: its other view is the
positive, the 2·world·batch − 2 others the negatives (a first loss of about
ln(2·world·batch − 1)). The other ranks' embeddings arrive through `all_gather_with_grad`, whose
backward sends each rank the gradient of its own rows. It gathers only in training: in
evaluation a rank short of rows evaluates padding, which would be among the others' negatives,
so the validation loss uses the rank's own batch (about ln(2·batch − 1) at first).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

from hydra_ddp.data import SPLITS, split_digits
from hydra_ddp.distributed import all_gather_with_grad


class DigitViews(Dataset):
    """Two views (shifted, noised, pixels dropped) of each digit image of a split, deterministic
    per item; the rows of `hydra_ddp.data.Digits` with the same fractions and seed."""

    def __init__(
        self,
        split: str,
        noise: float = 0.1,
        drop: float = 0.1,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        split_seed: int = 0,
    ) -> None:
        x, y, rows = split_digits(val_fraction, test_fraction, split_seed)
        self.x = torch.from_numpy(x[rows[split]]).view(-1, 8, 8)
        self.y = torch.from_numpy(y[rows[split]])
        self.seed, self.noise, self.drop = SPLITS.index(split) + 1, noise, drop

    def __len__(self) -> int:
        return len(self.y)

    def _view(self, image: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        shift = torch.randint(-1, 2, (2,), generator=g).tolist()
        image = torch.roll(image, shifts=shift, dims=(0, 1))
        image = image + self.noise * torch.randn(image.shape, generator=g)
        kept = torch.rand(image.shape, generator=g) >= self.drop
        return (image * kept).flatten()

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + i)
        return self._view(self.x[i], g), self._view(self.x[i], g), self.y[i]


class Encoder(nn.Module):
    """An MLP and a projection head; both views through the same weights, as unit vectors."""

    def __init__(self, in_features: int = 64, width: int = 128, dim: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_features, width), nn.ReLU(),
                                  nn.Linear(width, width), nn.ReLU())  # fmt: skip
        self.head = nn.Linear(width, dim)

    def forward(self, view_a: torch.Tensor, view_b: torch.Tensor) -> dict[str, torch.Tensor]:
        z = F.normalize(self.head(self.body(torch.cat([view_a, view_b]))), dim=1)
        a, b = z.chunk(2)
        return {"a": a, "b": b}


def nt_xent(output: dict, model: nn.Module, temperature: float = 0.5) -> torch.Tensor:
    """The NT-Xent loss of this rank's views, against every rank's views in training."""
    a, b = output["a"], output["b"]
    rank, rows = 0, len(a)
    if model.training and dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
        all_a, all_b = all_gather_with_grad(a), all_gather_with_grad(b)  # collective
    else:
        all_a, all_b = a, b
    total = len(all_a)  # world · batch
    candidates = torch.cat([all_a, all_b])  # (2·total, dim)
    anchors = torch.cat([a, b])  # (2·rows, dim)
    logits = anchors @ candidates.T / temperature
    mine = torch.arange(rows, device=a.device) + rank * rows  # this rank's rows, globally
    itself = torch.cat([mine, mine + total])
    positive = torch.cat([mine + total, mine])  # a's positive is its b, and b's its a
    logits[torch.arange(2 * rows, device=a.device), itself] = float("-inf")
    return F.cross_entropy(logits.float(), positive)
