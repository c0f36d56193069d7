"""The network. Its constructor takes its hyperparameters from conf/model/myproj.yaml and, by
name, what the data source's `spec` says about the data (`in_features`, `out_features`)."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """`depth` hidden layers of `hidden` units with GELU and dropout, then a linear head."""

    def __init__(
        self, in_features: int, out_features: int, hidden: int, depth: int, dropout: float
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU(), nn.Dropout(dropout)]
            width = hidden
        layers.append(nn.Linear(width, out_features))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
