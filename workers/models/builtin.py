"""The built-in architectures: ``digits_cnn``, ``resnet`` and ``mlp``, with BatchNorm."""

from __future__ import annotations

import itertools
from collections import OrderedDict

import torch
from torch import nn

from workers.models.spec import MAX_CLASSES, Architecture, int_param

__all__ = ["BUILTINS", "ConvBlock", "MLPBlock", "ResidualBlock", "digits_cnn", "mlp", "resnet"]


class ConvBlock(nn.Module):
    """conv3x3 -> BatchNorm2d -> ReLU, same spatial size."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))  # (B, C_out, H, W)


def digits_cnn(width: int = 16, num_classes: int = 10) -> nn.Module:
    """For 1x8x8 grey images (sklearn's load_digits scaled to [0, 1])."""
    return nn.Sequential(
        OrderedDict(
            block1=ConvBlock(1, width),  # (B, W, 8, 8)
            block2=ConvBlock(width, 2 * width),  # (B, 2W, 8, 8)
            pool=nn.MaxPool2d(2),  # (B, 2W, 4, 4)
            flatten=nn.Flatten(),  # (B, 2W*16)
            head=nn.Linear(2 * width * 4 * 4, num_classes),  # (B, num_classes)
        )
    )


class ResidualBlock(nn.Module):
    """Two conv3x3-BN pairs plus a shortcut (1x1 conv + BN where the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, C_in, H, W)
        h = torch.relu(self.bn1(self.conv1(x)))  # (B, C_out, H/stride, W/stride)
        return torch.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


def resnet(
    in_channels: int = 3, num_classes: int = 10, depth: int = 4, width: int = 32
) -> nn.Module:
    """Stem, ``depth`` residual blocks in three stages (width, 2*width, 4*width channels; each
    later stage halves the resolution), global average pool, linear head. Any input size."""
    blocks: list[nn.Module] = []
    channels = width
    for i in range(depth):
        out_channels = width * 2 ** (i * 3 // depth)
        blocks.append(ResidualBlock(channels, out_channels, 2 if out_channels > channels else 1))
        channels = out_channels
    return nn.Sequential(
        OrderedDict(
            stem=ConvBlock(in_channels, width),  # (B, W, H, W)
            blocks=nn.Sequential(*blocks),  # (B, C, H', W')
            pool=nn.AdaptiveAvgPool2d(1),  # (B, C, 1, 1)
            flatten=nn.Flatten(),  # (B, C)
            head=nn.Linear(channels, num_classes),  # (B, num_classes)
        )
    )


class MLPBlock(nn.Module):
    """Linear -> BatchNorm1d -> ReLU."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.bn = nn.BatchNorm1d(out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, F_in)
        return torch.relu(self.bn(self.linear(x)))  # (B, F_out)


def mlp(
    in_features: int = 64, hidden: int = 64, depth: int = 2, num_classes: int = 10
) -> nn.Module:
    sizes = [in_features] + [hidden] * depth
    return nn.Sequential(
        OrderedDict(
            blocks=nn.Sequential(*(MLPBlock(a, b) for a, b in itertools.pairwise(sizes))),
            head=nn.Linear(hidden, num_classes),  # (B, num_classes)
        )
    )


BUILTINS: tuple[Architecture, ...] = (
    Architecture(
        name="digits_cnn",
        description="Two conv-BN-ReLU blocks, a 2x2 max pool and a linear head, for 1x8x8 "
        "images such as sklearn's load_digits scaled to [0, 1].",
        factory=digits_cnn,
        params=(
            int_param(
                "width", 16, "Channels of the first block; the second has twice as many.", 1024
            ),
            int_param("num_classes", 10, "Number of output classes.", MAX_CLASSES),
        ),
        input_shape=lambda kw: (1, 8, 8),
        block_types=(ConvBlock,),
    ),
    Architecture(
        name="resnet",
        description="ResNet-style network with BatchNorm2d: a conv stem, `depth` residual "
        "blocks in three stages (width, 2x, 4x channels), global average pooling and a linear "
        "head. Fully convolutional: any image size.",
        factory=resnet,
        params=(
            int_param("in_channels", 3, "Channels of the input images.", 64),
            int_param("num_classes", 10, "Number of output classes.", MAX_CLASSES),
            int_param("depth", 4, "Number of residual blocks.", 64),
            int_param("width", 32, "Channels of the first stage.", 512),
        ),
        input_shape=lambda kw: (int(kw["in_channels"]), None, None),
        block_types=(ResidualBlock,),
    ),
    Architecture(
        name="mlp",
        description="Multi-layer perceptron: `depth` Linear-BatchNorm1d-ReLU blocks and a "
        "linear head, for flat feature vectors.",
        factory=mlp,
        params=(
            int_param("in_features", 64, "Features per sample.", 1_000_000),
            int_param("hidden", 64, "Width of the hidden layers.", 65_536),
            int_param("depth", 2, "Number of hidden blocks.", 64),
            int_param("num_classes", 10, "Number of outputs.", MAX_CLASSES),
        ),
        input_shape=lambda kw: (int(kw["in_features"]),),
        block_types=(MLPBlock,),
    ),
)
