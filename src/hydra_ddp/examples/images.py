"""A per-item image dataset with random crop and flip transforms, torch only: scikit-learn's
8x8 digits, each image padded to 10x10 and cropped back to a random 8x8 window (and flipped at
random) when training. `experiment=images`."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from hydra_ddp.data import split_digits


def random_crop_flip(image: torch.Tensor, pad: int = 1) -> torch.Tensor:
    """Pad by `pad` pixels, crop a random window of the original size, flip left-right with
    probability 1/2. Per item, from torch's global RNG (seeded per DataLoader worker)."""
    _, h, w = image.shape
    padded = torch.nn.functional.pad(image, [pad] * 4)
    top, left = torch.randint(0, 2 * pad + 1, (2,)).tolist()
    image = padded[:, top : top + h, left : left + w]
    return image.flip(-1) if torch.rand(()) < 0.5 else image


class DigitImages(Dataset):
    """One split of the digits as (image [1, 8, 8] in [0, 1], label) items: the same rows as
    `hydra_ddp.data.Digits` with the same fractions and seed (`hydra_ddp.data.split_digits`)."""

    def __init__(
        self,
        split: str,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        split_seed: int = 0,
        augment: bool = False,
    ) -> None:
        x, y, rows = split_digits(val_fraction, test_fraction, split_seed)
        self.images = torch.from_numpy(x[rows[split]]).view(-1, 1, 8, 8)
        self.labels = torch.from_numpy(y[rows[split]])
        self.augment = augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[i]
        return (random_crop_flip(image) if self.augment else image), self.labels[i]
