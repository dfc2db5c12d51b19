"""The training scripts' dataset: fixed points whose every fetch draws from all three global RNGs."""

from __future__ import annotations

import random

import numpy as np
import torch


class NoisyPoints:
    """Fixed points and labels; each fetch adds noise and a random sign flip and scale."""

    def __init__(self, length: int) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(length, 8, generator=generator)
        self.y = torch.randint(0, 3, (length,), generator=generator)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x = self.x[index] + 0.1 * torch.randn(8)
        sign = -1.0 if random.random() < 0.5 else 1.0
        return x * sign * float(np.random.uniform(0.9, 1.1)), self.y[index], index
