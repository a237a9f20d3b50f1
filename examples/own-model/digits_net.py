"""A user's own model: a small convolutional network for 8x8 digit images.

HetPipe calls `build(**model.args)` and splits the returned nn.Sequential between its children:
each child is one partition unit, so a stage boundary can fall between any two of them.
"""

from __future__ import annotations

from torch import nn


class Residual(nn.Module):
    """x + f(x): a unit with a skip connection stays whole on one stage."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())

    def forward(self, x):
        return x + self.body(x)


def build(*, channels: int = 32, blocks: int = 2, classes: int = 10) -> nn.Sequential:
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(1, channels, 3, padding=1), nn.ReLU()),
        *[Residual(channels) for _ in range(blocks)],
        nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten()),
        nn.Sequential(nn.Linear(4 * channels, 64), nn.ReLU()),
        nn.Linear(64, classes),
    )
