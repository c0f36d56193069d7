"""A user's per-item dataset, outside the package (tests/ is on sys.path): what
`data=torch data.train={_target_:helpers.user_data.Blobs,...}` points at in
test_own_data_models_and_steps.py. Each item is read one at a time, with a per-item transform;
`reads` records which rows were touched (to check that sampler=sharded touches only a rank's own
rows)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.data import Dataset


class Blobs(Dataset):
    """`rows` points around 4 centres in 8 dimensions; label = the centre."""

    def __init__(self, rows: int, seed: int, log_dir: str | None = None, noise: float = 0.3):
        g = torch.Generator().manual_seed(seed)
        centres = torch.randn(4, 8, generator=torch.Generator().manual_seed(123)) * 2
        self.y = torch.randint(0, 4, (rows,), generator=g)
        self.x = centres[self.y] + noise * torch.randn(rows, 8, generator=g)
        self.log_dir = log_dir

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.log_dir:  # one file per process: which rows it read
            with open(Path(self.log_dir) / f"reads_{os.getpid()}.txt", "a") as f:
                f.write(f"{i}\n")
        return self.x[i] * 1.0, self.y[i]  # a (trivial) per-item transform
