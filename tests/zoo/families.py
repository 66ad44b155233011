"""The zoo families the tests run (issue 28, point 7): small random-initialised instances that
build and step in well under a second each on a CPU."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

NUM_CLASSES: Final = 4
IMAGE_SIZE: Final = 32  # every family below takes 32x32 (a 1x1 map after its last stage)


@dataclass(frozen=True)
class Family:
    architecture: str
    block_class: str  # the class the blocks preset wraps
    kwargs: dict[str, Any] = field(default_factory=dict)
    running_stats: bool = True  # has BatchNorm layers that keep statistics

    def all_kwargs(self) -> dict[str, Any]:
        return {"num_classes": NUM_CLASSES, **self.kwargs}


FAMILIES: Final = (
    Family("torchvision.resnet18", "BasicBlock"),
    Family("torchvision.efficientnet_b0", "MBConv"),
    Family("torchvision.mobilenet_v3_small", "InvertedResidual"),
    Family("torchvision.regnet_y_400mf", "ResBottleneckBlock"),
    Family("torchvision.densenet121", "_DenseBlock"),
    Family("torchvision.convnext_tiny", "CNBlock", running_stats=False),
    Family("torchvision.vit_b_16", "EncoderBlock", {"image_size": IMAGE_SIZE}, running_stats=False),
    Family("torchvision.shufflenet_v2_x0_5", "InvertedResidual"),
    Family("torchvision.mnasnet0_5", "_InvertedResidual"),
    # timm: stochastic depth and dropout on, as people fine-tune them.
    Family("timm.resnet18", "BasicBlock", {"drop_path_rate": 0.1, "drop_rate": 0.1}),
    Family("timm.efficientnet_b0", "InvertedResidual", {"drop_path_rate": 0.1}),
    Family("timm.mobilenetv3_small_050", "InvertedResidual", {"drop_path_rate": 0.1}),
    Family("timm.regnetx_002", "Bottleneck", {"drop_path_rate": 0.1}),
    Family("timm.convnext_atto", "ConvNeXtBlock", {"drop_path_rate": 0.1}, running_stats=False),
)
