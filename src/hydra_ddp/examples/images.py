"""A per-item image dataset with random crop and flip transforms, torch only: scikit-learn's
8x8 digits, each image padded to 10x10 and cropped back to a random 8x8 window (and flipped at
random) when training. `experiment=images`."""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits
from torch.utils.data import Dataset


class RandomCropFlip:
    """Pad by `pad` pixels, crop a random window of the original size, flip left-right with
    probability 1/2. Per item, from torch's global RNG (seeded per DataLoader worker)."""

    def __init__(self, pad: int = 1, flip: bool = True) -> None:
        self.pad, self.flip = pad, flip

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        _, h, w = image.shape
        padded = torch.nn.functional.pad(image, [self.pad] * 4)
        top, left = torch.randint(0, 2 * self.pad + 1, (2,)).tolist()
        image = padded[:, top : top + h, left : left + w]
        if self.flip and torch.rand(()) < 0.5:
            image = image.flip(-1)
        return image


class DigitImages(Dataset):
    """One split of the digits as (image [1, 8, 8] in [0, 1], label) items: the same split of
    rows as `hydra_ddp.data.Digits` (a seeded permutation: the first `test_fraction` of it
    test, the next `val_fraction` val)."""

    def __init__(
        self,
        split: str,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        split_seed: int = 0,
        augment: bool = False,
    ) -> None:
        digits = load_digits()
        n = len(digits.target)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(split_seed))
        n_test, n_val = int(n * test_fraction), int(n * val_fraction)
        rows = {
            "test": order[:n_test],
            "val": order[n_test : n_test + n_val],
            "train": order[n_test + n_val :],
        }[split]
        images = torch.tensor(digits.images, dtype=torch.float32)[rows] / 16.0
        self.images = images.unsqueeze(1)
        self.labels = torch.tensor(digits.target)[rows]
        self.transform = RandomCropFlip() if augment else None

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[i]
        return (self.transform(image) if self.transform else image), self.labels[i]
