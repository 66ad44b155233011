"""The model zoo: torchvision's and timm's classification models as architectures.

Each library is optional (the ``zoo`` extra installs both): a source yields nothing when its
library does not import. Models are built randomly initialised; nothing is downloaded, weights
are uploaded instead.

- ``torchvision.<name>``: every model of ``torchvision.models.list_models(module=models)``
  (the classification models), with ``num_classes`` and, for the ViTs, ``image_size``;
- ``timm.<name>``: every model of ``timm.list_models()``, with ``num_classes``, ``in_chans``,
  ``drop_rate``, ``drop_path_rate`` and, for models whose input size is fixed (ViTs, Swin,
  ...), ``img_size``.

Block types (NOTE [ The blocks rule ] in workers/models/policy.py): each source names the
block classes of its families that it knows; a model made of none of them falls back on the
structural rule there.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

from torch import nn

from workers.errors import ArchitectureError
from workers.models.spec import MAX_CLASSES, Architecture, InputShape, ParamSpec, int_param

__all__ = ["from_timm", "from_torchvision", "timm_block_types", "torchvision_block_types"]

MAX_SIZE: Final = 4096
MAX_IN_CHANS: Final = 64

# (module of torchvision.models, class): the repeated blocks of each family.
_TORCHVISION_BLOCKS: Final = (
    ("resnet", "BasicBlock"),
    ("resnet", "Bottleneck"),
    ("mobilenetv2", "InvertedResidual"),
    ("mobilenetv3", "InvertedResidual"),
    ("efficientnet", "MBConv"),
    ("efficientnet", "FusedMBConv"),
    ("regnet", "ResBottleneckBlock"),
    # Not _DenseLayer: its input is the list of features so far, which _DenseBlock appends to
    # after the call, so a recomputation would see more features than the forward did.
    ("densenet", "_DenseBlock"),
    ("convnext", "CNBlock"),
    ("vision_transformer", "EncoderBlock"),
    ("shufflenetv2", "InvertedResidual"),
    ("mnasnet", "_InvertedResidual"),
    ("swin_transformer", "SwinTransformerBlock"),
    ("swin_transformer", "SwinTransformerBlockV2"),
    ("maxvit", "MaxVitLayer"),
    ("squeezenet", "Fire"),
)

# (module of timm.models, class).
_TIMM_BLOCKS: Final = (
    ("resnet", "BasicBlock"),
    ("resnet", "Bottleneck"),
    ("_efficientnet_blocks", "DepthwiseSeparableConv"),
    ("_efficientnet_blocks", "InvertedResidual"),
    ("_efficientnet_blocks", "EdgeResidual"),
    ("_efficientnet_blocks", "CondConvResidual"),
    ("_efficientnet_blocks", "UniversalInvertedResidual"),
    ("regnet", "Bottleneck"),
    ("convnext", "ConvNeXtBlock"),
    ("vision_transformer", "Block"),
    ("vision_transformer", "ResPostBlock"),
    ("swin_transformer", "SwinTransformerBlock"),
    ("densenet", "DenseBlock"),  # as torchvision's: its layers take a list that grows
)


def _classes(package: Any, names: tuple[tuple[str, str], ...]) -> tuple[type[nn.Module], ...]:
    """The classes of ``names`` the installed version has (others are skipped)."""
    found: list[type[nn.Module]] = []
    for module_name, class_name in names:
        module = getattr(package, module_name, None)
        if module is None:
            try:
                module = importlib.import_module(f"{package.__name__}.{module_name}")
            except (ImportError, AttributeError):
                continue
        cls = getattr(module, class_name, None)
        if isinstance(cls, type) and issubclass(cls, nn.Module) and cls not in found:
            found.append(cls)
    return tuple(found)


def torchvision_block_types(models: Any) -> tuple[type[nn.Module], ...]:
    return _classes(models, _TORCHVISION_BLOCKS)


def timm_block_types(models: Any) -> tuple[type[nn.Module], ...]:
    return _classes(models, _TIMM_BLOCKS)


def _checked_call(name: str, build: Callable[..., nn.Module], **kwargs: Any) -> nn.Module:
    try:
        return build(**kwargs)
    # A kwarg this model's class does not take (TypeError), or a value it refuses (torchvision
    # asserts, timm raises ValueError): the caller's to fix, so not a failure of the service.
    except (TypeError, ValueError, AssertionError) as exc:
        raise ArchitectureError(
            f"{name} cannot be built with {kwargs}: {exc}; leave that kwarg at its default"
        ) from exc


def _num_classes() -> ParamSpec:
    return int_param("num_classes", 1000, "Number of output classes.", MAX_CLASSES)


def _rate(name: str, description: str) -> ParamSpec:
    return ParamSpec(name, "float", 0.0, description, minimum=0.0, maximum=1.0)


def _any_size_rgb(kwargs: Mapping[str, Any]) -> InputShape:
    return (3, None, None)


def _any_size(channels: str, kwargs: Mapping[str, Any]) -> InputShape:
    return (int(kwargs[channels]), None, None)


def _square(size: str, channels: str | None, kwargs: Mapping[str, Any]) -> InputShape:
    """(C, size, size): C from the kwarg ``channels`` (None: 3)."""
    c = 3 if channels is None else int(kwargs[channels])
    return (c, int(kwargs[size]), int(kwargs[size]))


def _torchvision_factory(
    models: Any, name: str, num_classes: int, image_size: int | None = None
) -> nn.Module:
    kwargs: dict[str, Any] = {"weights": None, "num_classes": num_classes}
    if image_size is not None:
        kwargs["image_size"] = image_size
    return _checked_call(f"torchvision.{name}", functools.partial(models.get_model, name), **kwargs)


def from_torchvision() -> Iterator[Architecture]:
    try:
        torchvision = importlib.import_module("torchvision")
    except Exception:  # noqa: BLE001 - optional: absent or broken (ABI mismatch) alike
        return
    models = torchvision.models
    blocks = torchvision_block_types(models)
    for name in models.list_models(module=models):
        params: tuple[ParamSpec, ...] = (_num_classes(),)
        shape = _any_size_rgb
        if name.startswith("vit_"):  # a ViT's position embedding fixes its image size
            params += (
                int_param(
                    "image_size",
                    224,
                    "Height and width of the input images; a multiple of the patch size.",
                    MAX_SIZE,
                ),
            )
            shape = functools.partial(_square, "image_size", None)
        yield Architecture(
            name=f"torchvision.{name}",
            description=f"torchvision.models.{name}, randomly initialised (no pretrained "
            "weights are downloaded; upload weights instead).",
            factory=functools.partial(_torchvision_factory, models, name),
            params=params,
            input_shape=shape,
            block_types=blocks,
        )


def _timm_factory(timm: Any, name: str, defaults: Mapping[str, Any], **kwargs: Any) -> nn.Module:
    # Only num_classes and the kwargs changed from their defaults reach the model: not every
    # timm model takes drop_path_rate (say), and the defaults must build every model.
    given = {k: v for k, v in kwargs.items() if k == "num_classes" or v != defaults[k]}
    return _checked_call(
        f"timm.{name}", functools.partial(timm.create_model, name, pretrained=False), **given
    )


def from_timm() -> Iterator[Architecture]:
    try:
        timm = importlib.import_module("timm")
        get_pretrained_cfg = importlib.import_module("timm.models").get_pretrained_cfg
    except Exception:  # noqa: BLE001 - optional: absent or broken alike
        return
    blocks = timm_block_types(timm.models)
    common = (
        _num_classes(),
        int_param("in_chans", 3, "Channels of the input images.", MAX_IN_CHANS),
        _rate("drop_rate", "Dropout rate before the classifier."),
        _rate("drop_path_rate", "Stochastic depth rate (the last block's; 0 turns it off)."),
    )
    for name in timm.list_models():
        cfg = get_pretrained_cfg(name)
        params: tuple[ParamSpec, ...] = common
        shape = functools.partial(_any_size, "in_chans")
        if cfg is not None and cfg.fixed_input_size:
            size = int(cfg.input_size[-1])
            params += (
                int_param("img_size", size, "Height and width of the input images.", MAX_SIZE),
            )
            shape = functools.partial(_square, "img_size", "in_chans")
        yield Architecture(
            name=f"timm.{name}",
            description=f"timm's {name}, randomly initialised (upload weights).",
            factory=functools.partial(
                _timm_factory, timm, name, {p.name: p.default for p in params}
            ),
            params=params,
            input_shape=shape,
            block_types=blocks,
        )
