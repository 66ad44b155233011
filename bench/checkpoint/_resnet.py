"""The benchmarks' model: a small ResNet with BatchNorm for 32x32 RGB images and 10 classes.

A stem, 8 basic residual blocks (4 of 32 channels at 32x32, 4 of 64 channels at 16x16) and a
linear head; ``Block`` is the unit a benchmark checkpoints.
"""

from __future__ import annotations

import torch
from torch import nn

IMAGE_SIZE = 32
CLASSES = 10


class Block(nn.Module):
    """A basic residual block: two 3x3 conv-BN pairs, plus a 1x1 conv-BN shortcut where the
    shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C_in, H, W)
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))  # (B, C_out, H / stride, W / stride)


class ResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU()
        )
        self.blocks = nn.Sequential(
            *(Block(32, 32, 1) for _ in range(4)),
            Block(32, 64, 2),
            *(Block(64, 64, 1) for _ in range(3)),
        )
        self.head = nn.Linear(64, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, 32, 32)
        features = self.blocks(self.stem(x))  # (B, 64, 16, 16)
        return self.head(features.mean(dim=(2, 3)))  # (B, CLASSES)
