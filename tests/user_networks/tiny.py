"""A user's own network, as a researcher would bring one (model.factory = 'user_networks.tiny:net')."""
from __future__ import annotations

import torch
from torch import nn


class TinyNet(nn.Module):
    """Conv-BN-ReLU down, conv up: N x 1 x H x W -> N x classes x H x W (H, W even)."""

    def __init__(self, width: int = 8, classes: int = 1):
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(1, width, 3, stride=2, padding=1),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.middle = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width),
                                    nn.ReLU())
        self.up = nn.ConvTranspose2d(width, classes, 2, stride=2)
        self.sigmoid = nn.Sigmoid() if classes == 1 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sigmoid(self.up(self.middle(self.down(x))))


def net(width: int = 8, classes: int = 1) -> nn.Module:
    return TinyNet(width, classes)


def not_a_module(**_) -> str:
    return "a string"


def wrong_shape(**_) -> nn.Module:
    return nn.Conv2d(1, 1, 3, stride=2, padding=1)  # halves the image


def broken(**_) -> nn.Module:
    raise RuntimeError("the user's code fails")
