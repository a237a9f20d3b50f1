"""A user's own data: scikit-learn's 8x8 digits as a map-style Dataset of (image, label).

`train` and `held_out` split the 1797 images by a fixed rule (every fifth image is held out), so
HetPipe evaluates on images it never trained on. Each item is one image of shape [1, 8, 8].
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch.utils.data import Dataset


class Digits(Dataset):
    def __init__(self, held_out: bool) -> None:
        digits = load_digits()
        keep = (np.arange(len(digits.target)) % 5 == 0) == held_out
        self.images = torch.tensor(digits.images[keep] / 16.0, dtype=torch.float32).unsqueeze(1)
        self.labels = torch.tensor(digits.target[keep], dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


def train() -> Digits:
    return Digits(held_out=False)


def held_out() -> Digits:
    return Digits(held_out=True)
